"""``Rig``: the low-level API a hand-written PyTorch loop adds to run anywhere."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import nn

from torchrig import arguments, gather, speedups
from torchrig.accelerators import Accelerator
from torchrig.checkpoint.background import BackgroundSaves
from torchrig.data import RigDataLoader
from torchrig.fp8 import FP8Mixed
from torchrig.nested import apply_to_tensors, move_to_device
from torchrig.precision import Precision
from torchrig.preemption import SignalsLike, SignalWatch, resolve_signals
from torchrig.preparing import Preparing
from torchrig.resolve import Plan, resolve
from torchrig.save_load import SaveLoad
from torchrig.strategies import Strategy
from torchrig.strategies.base import check_reduce_op
from torchrig.strategies.launch import launch_first
from torchrig.wrappers import RigModule, RigOptimizer, as_prepared


class Rig(Preparing, SaveLoad):
    """Runs a hand-written training loop on any accelerator, precision and process layout.

    Args:
        accelerator: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"gpu"``, ``"mps"``, ``"xpu"``, ``"tpu"``,
            any registered name, or an :class:`~torchrig.Accelerator` instance.
        devices: a count, ``-1``/``"auto"`` for all, ``"0,1"``, or a list of indices. On the CPU
            this is the number of processes.
        strategy: ``"auto"``, ``"single"``, ``"ddp"``, ``"ddp_spawn"``, ``"fsdp"``..., or a
            :class:`~torchrig.Strategy` instance.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ``"16-true"``, ``"64-true"``, ``"auto"``, a :class:`~torchrig.precision.Precision`, or
            a :class:`~torchrig.FP8Mixed`.
        num_nodes: how many machines take part.
        timeout: how long a collective waits for the other ranks before it fails (seconds or a
            ``timedelta``; default: the strategy's, 10 minutes). It is the process group's timeout,
            passed to every backend. A timed-out torchrig collective names, for every rank, the
            collective it was in (see docs/distributed.md, "Hangs").
        compile: ``None`` (off), ``True`` (``torch.compile`` the whole model), ``"regional"`` (each
            repeated block: the children of one class of an ``nn.ModuleList``/``nn.Sequential``), or a
            dict of ``torch.compile`` arguments (``"regional": True`` allowed). Applied by ``prepare``.
        activation_checkpointing: ``None``, a set of block classes (``{Block}``), ``"full"`` (every
            repeated block), ``"selective"`` (every second one: blocks 0, 2, 4...) or
            ``("selective", n)`` (every n-th). Recomputes the blocks' activations in backward.
            See docs/speed.md; state-dict keys never change with either.

    ``None`` means the ``TORCHRIG_*`` environment variable that ``torchrig run`` sets, and then
    the default (auto, auto, auto, 32-true, 1); a ``strategy``/``precision`` left ``None`` is
    first taken from the accelerator when it carries one (``CPUAccelerator(precision="bf16")``).

    Example:
        >>> import torch, torchrig
        >>> rig = torchrig.Rig(accelerator="cpu", precision="bf16-mixed")
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = rig.prepare(model, optimizer)
        >>> loss = model(torch.ones(2, 4)).sum()
        >>> rig.backward(loss); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        *,
        accelerator: str | Accelerator | None = None,
        devices: int | str | list[int] | None = None,
        strategy: str | Strategy | None = None,
        precision: str | int | Precision | FP8Mixed | None = None,
        num_nodes: int | None = None,
        timeout: float | timedelta | None = None,
        compile: bool | str | dict[str, Any] | None = None,
        activation_checkpointing: Any = None,
    ) -> None:
        self._compile = speedups.resolve_compile(compile)
        self._activation_checkpointing = speedups.resolve_activation_checkpointing(activation_checkpointing)
        self.plan: Plan = resolve(
            accelerator=accelerator, devices=devices, strategy=strategy, precision=precision, num_nodes=num_nodes
        )
        if timeout is not None:  # how long a collective waits for the other ranks; one process never waits
            from torchrig.strategies.parallel import ParallelStrategy

            seconds = arguments.timeout(timeout)
            if isinstance(self.strategy, ParallelStrategy):
                self.strategy.timeout = seconds
        # Weak, so an object that died cannot make a new one at the same id() look prepared.
        self._prepared: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        #: The prepared loader that yielded the batch being processed: the last one of this Rig's
        #: prepared loaders to give out a batch (None before the first). ``gather_for_metrics``
        #: reads it to drop the duplicates a distributed sampler pads that loader's last batch with.
        self.current_loader: RigDataLoader | None = None
        #: Backward passes since a prepared optimizer last stepped (gradients accumulated that no
        #: checkpoint holds): ``save`` warns while there are any.
        self.backwards_unstepped = 0
        self._launched = False
        self._signal_watch: SignalWatch | None = None
        #: ``rig.save(..., blocking=False)``: the save under way, its host memory and process group.
        self.background_saves = BackgroundSaves()
        if not self.strategy.needs_launch:
            self.strategy.setup_environment()
            self._launched = True

    # -- what the plan holds ---------------------------------------------------------------
    @property
    def accelerator(self) -> Accelerator:
        return self.plan.accelerator

    @property
    def strategy(self) -> Strategy:
        return self.plan.strategy

    @property
    def precision(self) -> Precision:
        return self.plan.precision

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.strategy.root_device

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self.strategy.node_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    def __repr__(self) -> str:
        return (
            f"Rig(accelerator={self.accelerator.name()!r}, device={str(self.device)!r}, "
            f"strategy={self.strategy!r}, precision={self.precision.name!r}, world_size={self.world_size})"
        )

    # -- processes -------------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(rig, *args)`` in every process of the run.

        Under torchrun, SLURM, or a single process this starts nothing and simply calls
        ``fn`` here; strategies that must start their own processes (``ddp_spawn``,
        ``ddp_notebook``) start them and call ``fn`` in each.
        """

        # A partial of a module-level function (not a closure) so ``spawn`` can pickle it.
        return self.strategy.launch(functools.partial(_run_launched, self, fn), *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # ``ddp_spawn`` pickles the Rig into each worker; the weak bookkeeping of prepared
        # objects cannot be pickled and starts empty there (nothing is prepared before launch).
        state = dict(self.__dict__)
        state["_prepared"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._prepared = weakref.WeakValueDictionary()

    # -- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` through the precision (scaled under 16-mixed)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"rig.backward(loss) takes the loss tensor; got {type(loss).__name__}")
        self.backwards_unstepped += 1
        self.plan.precision.backward(loss, **kwargs)

    def forward_backward(
        self, module: nn.Module, loss_fn: Callable[..., torch.Tensor], *args: Any, target: Any
    ) -> torch.Tensor:
        """``loss = loss_fn(module(*args), target)`` and ``rig.backward(loss)`` in one call, on every layout.

        With pipeline parallel (``ModelParallelStrategy(pipeline_parallel=...)``) the model is cut
        into stages on different ranks, so no rank can run ``module(x)`` alone: this call runs the
        strategy's pipeline schedule over the batch, split into microbatches, and ``loss_fn`` runs
        on the last stage for each. Returns the loss of the whole batch (the mean over the
        microbatches), detached, the same on every rank. Write the step this way and the loop runs
        unchanged on one device, DDP, FSDP and pipelines. (Evaluation needs nothing of the kind:
        under ``torch.no_grad()`` a pipelined ``model(x)`` runs a forward-only schedule and returns
        the output on every rank.)

        Example:
            >>> import torch, torchrig
            >>> rig = torchrig.Rig(accelerator="cpu")
            >>> model = rig.prepare(torch.nn.Linear(2, 1))
            >>> mse = torch.nn.functional.mse_loss
            >>> loss = rig.forward_backward(model, mse, torch.ones(4, 2), target=torch.zeros(4, 1))
        """
        if not isinstance(module, RigModule):
            raise TypeError(
                f"forward_backward() takes the module prepare() returned; got a {type(module).__name__}: "
                "call model = rig.prepare(model) first"
            )
        self.backwards_unstepped += 1
        return self.strategy.forward_backward(module, loss_fn, args, target)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
        norm_type: float = 2.0,
    ) -> torch.Tensor | None:
        """Clip gradients by total norm (``max_norm``) or by value (``clip_val``), after unscaling.

        Returns the total norm before clipping (a tensor on the device, no host sync) when
        clipping by norm, else None.

        Example:
            >>> import torch, torchrig
            >>> rig = torchrig.Rig(accelerator="cpu")
            >>> model = torch.nn.Linear(2, 1)
            >>> model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> rig.backward(model(torch.ones(1, 2)).sum())
            >>> norm = rig.clip_gradients(model, optimizer, max_norm=1.0)
        """
        if (max_norm is None) == (clip_val is None):
            raise ValueError(
                f"clip_gradients() takes exactly one of max_norm= or clip_val= "
                f"(got max_norm={max_norm!r}, clip_val={clip_val!r})"
            )
        if max_norm is not None:
            max_norm = arguments.clip_threshold("max_norm", max_norm)
        if clip_val is not None:
            clip_val = arguments.clip_threshold("clip_val", clip_val)
        return self._clip_checked(optimizer, max_norm, clip_val, norm_type)

    def _clip_checked(
        self, optimizer: torch.optim.Optimizer, max_norm: float | None, clip_val: float | None, norm_type: float
    ) -> torch.Tensor | None:
        """:meth:`clip_gradients` once its arguments are known to be good (the Trainer checks its
        ``gradient_clip_val`` when it is built, so its steps skip the checks)."""
        raw = optimizer.optimizer if isinstance(optimizer, RigOptimizer) else optimizer
        self.precision.unscale_gradients(raw)
        params = [p for g in raw.param_groups for p in g["params"] if p.grad is not None]
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(params, clip_val)
            return None
        return self.strategy.clip_grad_norm(params, max_norm, norm_type)  # type: ignore[arg-type]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast, for computation outside a prepared module's forward."""
        return self.precision.autocast()

    def to_device(self, obj: Any) -> Any:
        """Move a tensor, a module, or a nested batch to ``rig.device``."""
        if isinstance(obj, nn.Module):
            return obj.to(self.device)
        return move_to_device(obj, self.device)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce inside the block (for gradient accumulation).

        Example:
            >>> # with rig.no_backward_sync(model, enabled=not last_micro_batch): rig.backward(loss)
        """
        prepared = as_prepared(module)
        if prepared is None:
            raise TypeError(
                f"no_backward_sync() needs the module that rig.prepare() returned (or torch.compile of it); "
                f"got a {type(module).__name__} that was not prepared: pass model, where "
                "model, optimizer = rig.prepare(model, optimizer)"
            )
        if not enabled:
            return contextlib.nullcontext()
        return self.strategy.no_backward_sync(prepared._forward_module, enabled)

    @contextlib.contextmanager
    def init_module(self, empty_init: bool = False) -> Iterator[None]:
        """Create a module's parameters directly on the device, in the precision's dtype.

        With ``empty_init=True`` parameters are created on ``meta`` (no memory, no init time)
        and materialised by ``prepare`` (on each rank's shard only under FSDP) by calling each
        submodule's ``reset_parameters()``.

        Example:
            >>> import torch, torchrig
            >>> rig = torchrig.Rig(accelerator="cpu", precision="bf16-true")
            >>> with rig.init_module():
            ...     model = torch.nn.Linear(2, 2)
            >>> model.weight.dtype
            torch.bfloat16
        """
        with self.strategy.module_init_context(empty_init), self.precision.init_context():
            yield

    def seed_everything(self, seed: int) -> int:
        """Seed Python, NumPy and torch (every device) on every process; returns the seed."""
        return seed_everything(seed)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # -- collectives (free in one process) -------------------------------------------------
    def all_gather(self, obj: Any, sync_grads: bool = False) -> Any:
        """Gather tensors (or nested collections of them) from every process: ``(world, *shape)``."""
        return apply_to_tensors(obj, lambda t: self.strategy.all_gather(t, sync_grads=sync_grads))

    def all_reduce(self, obj: Any, op: str = "mean") -> Any:
        """Reduce tensors across processes with ``op`` in ``mean``, ``sum``, ``max``, ``min``."""
        check_reduce_op(op)
        return apply_to_tensors(obj, lambda t: self.strategy.all_reduce(t, op=op))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send ``obj`` (a tensor or any picklable object) from rank ``src`` to every rank."""
        return self.strategy.broadcast(obj, src=src)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""
        self.strategy.barrier(name)

    def reduce_boolean_decision(self, flag: bool, all: bool = True) -> bool:
        """True when every rank (``all=True``) or any rank (``all=False``) says True."""
        return self.strategy.reduce_boolean_decision(flag, all=all)

    def preempted(self, signals: SignalsLike = "auto") -> signal.Signals | None:
        """The stop signal the ranks agreed on, or None: call it once per step, on every rank.

        The first call installs handlers for ``signals`` (``"auto"``: SIGTERM and SIGINT, and
        SIGUSR1 under SLURM) that only note a signal, so from then on those signals no longer kill
        the process. Each call is collective but never waits: with several processes the ranks
        check together about once a second of training (an asynchronous all-reduce, read at the
        next check), so every rank sees the signal at the same step, within about two seconds of
        the first rank's, even when only one rank was signalled. Then save and stop::

            for step, (x, y) in enumerate(loader):
                ...
                if sig := rig.preempted():
                    rig.save("ckpt/last-step", {"model": model, "optimizer": optimizer, "step": step})
                    raise torchrig.Preempted(sig)  # exit status 128 + signal number

        See docs/rig.md, "Preemption".
        """
        watch = self._signal_watch
        if watch is None:
            if not self._launched:
                raise RuntimeError(launch_first(self.strategy, "rig.preempted()"))
            watch = self._signal_watch = SignalWatch(self.strategy, resolve_signals(signals, "signals")).install()
        found = watch.poll()
        return signal.Signals(found) if found else None

    def rank_zero_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on rank 0 first (say, to download), then on the others."""
        return self.strategy.rank_zero_first()

    def gather_for_metrics(self, obj: Any) -> Any:
        """``all_gather`` flattened to one batch dimension, without the duplicate samples a
        distributed sampler pads the last batch with (the batch :attr:`current_loader` gave out).

        See :func:`torchrig.gather.gather_for_metrics`."""
        return gather.gather_for_metrics(self, obj)


def _run_launched(rig: Rig, fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    """What ``Rig.launch`` runs in every process: join the process group, then ``fn(rig, ...)``."""
    if not rig._launched:
        rig.strategy.setup_environment()
        rig._launched = True
    return None if fn is None else fn(rig, *args, **kwargs)


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy and torch on the CPU and every device."""
    arguments.seed("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every device type as well
    os.environ["PYTHONHASHSEED"] = str(seed % 2**32)  # what Python accepts: a child fails to start otherwise
    return seed
