"""``Rig``: the low-level API a hand-written PyTorch loop adds to run anywhere."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import signal
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from torchrig import arguments, checkpoint, gather, speedups
from torchrig.accelerators import Accelerator
from torchrig.checkpoint.background import BackgroundSaves, SaveHandle
from torchrig.data import RigDataLoader, loader_kwargs, rebuild_iterable, rebuild_with_sampler
from torchrig.fp8 import FP8Mixed
from torchrig.nested import apply_to_tensors, move_to_device
from torchrig.precision import Precision, check_optimizer_eps
from torchrig.preemption import SignalsLike, SignalWatch, resolve_signals
from torchrig.resolve import Plan, resolve
from torchrig.strategies import Strategy
from torchrig.strategies.base import check_reduce_op, reset_parameters
from torchrig.strategies.launch import launch_first
from torchrig.wrappers import RigModule, RigOptimizer, as_prepared, wrap_optimizer

if TYPE_CHECKING:
    from torchrig.checkpoint.remote import CheckpointURL


class Rig:
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

    # -- prepare ---------------------------------------------------------------------------
    def prepare(self, *objs: Any, use_distributed_sampler: bool = True) -> Any:
        """Prepare modules, optimizers, dataloaders and LR schedulers, in any order.

        Modules move to the device (and are wrapped by the strategy); optimizers step through
        the precision; dataloaders yield batches on the device; schedulers pass through.
        Returns the objects in the order given (a single object when one was given).

        ``use_distributed_sampler=False``: dataloaders keep their own sampler and dataset as
        they are (for loaders that already give each process its share); see :meth:`setup_dataloader`.
        """
        if not objs:
            raise ValueError("prepare() needs at least one module, optimizer, dataloader or scheduler")
        if not self._launched:
            raise RuntimeError(launch_first(self.strategy, "rig.prepare()"))
        for obj in objs:
            self._check_preparable(obj)
        out: list[Any] = list(objs)
        modules = [i for i, o in enumerate(objs) if isinstance(o, nn.Module)]
        optimizers = [i for i, o in enumerate(objs) if isinstance(o, torch.optim.Optimizer)]
        replaced: dict[int, nn.Parameter] = {}
        for i in modules:
            before = list(objs[i].parameters())
            out[i] = self._setup_module(objs[i])
            replaced.update(_replaced_params(before, list(objs[i].parameters())))
        for i in optimizers:
            _rebind_params(objs[i], replaced)
            out[i] = self._setup_optimizer(objs[i])
        for i, o in enumerate(objs):
            if isinstance(o, DataLoader):
                out[i] = self.setup_dataloader(o, use_distributed_sampler=use_distributed_sampler)
        for o in (*objs, *out):
            with contextlib.suppress(TypeError):  # an object that takes no weak reference
                self._prepared[id(o)] = o
        return out[0] if len(out) == 1 else tuple(out)

    def _check_preparable(self, obj: Any) -> None:
        prepared = isinstance(obj, (RigOptimizer, RigDataLoader)) or as_prepared(obj) is not None
        known = self._prepared.get(id(obj))  # None when unknown: a None given is not "already prepared"
        if prepared or (known is not None and known is obj):
            raise ValueError(
                f"{type(obj).__name__} was already prepared by this Rig; prepare each object once "
                "and use what prepare() returned"
            )
        if not isinstance(obj, (nn.Module, torch.optim.Optimizer, DataLoader, LRScheduler, ReduceLROnPlateau)):
            raise TypeError(
                f"prepare() got a {type(obj).__module__}.{type(obj).__name__}; it takes nn.Module, "
                "torch.optim.Optimizer, torch.utils.data.DataLoader and LR schedulers"
            )

    def _setup_module(self, module: nn.Module) -> RigModule:
        module, compiled_before = speedups.unwrap_compiled(module)  # its keys then have no ``_orig_mod.``
        if compiled_before is not None and self._compile is not None:
            raise ValueError(
                "the model was compiled before prepare() (torch.compile) and the Rig has compile= too; "
                "pass the uncompiled model, or leave compile=None to keep your compilation"
            )
        module = self.precision.convert_module(module)
        # In place and lazy (nothing is traced before the first call): tensor parallel and FSDP/DDP,
        # applied next by the strategy, are in place when the compiled code is traced.
        speedups.apply(module, self._compile, self._activation_checkpointing, compiled_before)
        on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        if on_meta and not self.strategy.materializes_meta:
            materialize(module, self.device)
        forward_module = self.strategy.setup_module(module)
        # A strategy that keeps the base ``setup_module`` only moves the module: nothing wraps its forward.
        plain = type(self.strategy).setup_module is Strategy.setup_module
        return RigModule(
            forward_module=forward_module, module=module, precision=self.precision, device=self.device, plain=plain
        )

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if any(p.is_meta for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "the optimizer holds parameters on the meta device (created under "
                "rig.init_module(empty_init=True)) whose module was not prepared with it; prepare "
                "them together, rig.prepare(model, optimizer), or create the optimizer after prepare"
            )
        check_optimizer_eps(optimizer, self.precision.name)
        optimizer = self.strategy.setup_optimizer(optimizer)
        for state in optimizer.state.values():  # state created before prepare follows the params
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(self.device)
        return wrap_optimizer(optimizer, self.precision)

    def setup_dataloader(self, loader: DataLoader[Any], *, use_distributed_sampler: bool = True) -> RigDataLoader:
        """A new loader over ``loader``'s data for this Rig: batches on its device, each process
        its share (what :meth:`prepare` does to a DataLoader), without recording ``loader`` as
        prepared, so it can also be prepared, or set up again, later. For a pass over data the run
        also trains on, made apart from it: a tuning sweep, an evaluation in its own order. Each
        call draws a new shuffle seed from torch's RNG, as :meth:`prepare` does.

        ``use_distributed_sampler=False``: ``loader``'s sampler and dataset are kept as they are (no
        resumable sampler splitting it across processes, no stream split): for a loader that
        already gives each process its own share. Its batches still arrive on the device and its
        position is still saved (a map-style loader resumes by skipping indices of its own sampler).
        """
        if not isinstance(loader, DataLoader):
            raise TypeError(f"setup_dataloader() takes a torch.utils.data.DataLoader; got {type(loader).__name__}")
        if not isinstance(use_distributed_sampler, bool):
            raise TypeError(f"use_distributed_sampler={use_distributed_sampler!r} must be True or False")
        if not use_distributed_sampler:
            return RigDataLoader(loader, device=self.device, on_batch=self._batch_from, strategy=self.strategy)
        # The shuffle seed comes from torch's RNG (so seed_everything fixes it) and rank 0 decides;
        # a loader that does not shuffle takes no draw (the run's RNG stream is the hand-written loop's).
        shuffles = isinstance(loader.sampler, RandomSampler)
        seed = self.strategy.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item())) if shuffles else 0
        pin = self.device.type not in ("cpu", "mps")
        replicas, rank = self.strategy.data_parallel_size, self.strategy.data_parallel_rank
        rebuilt = rebuild_with_sampler(loader, seed=seed, num_replicas=replicas, rank=rank, pin_memory=pin)
        if rebuilt is None:
            kw = loader_kwargs(loader)
            kw["pin_memory"] = kw["pin_memory"] or pin
            rebuilt = rebuild_iterable(loader, kwargs=kw, num_replicas=replicas, rank=rank)
        # A map-style loader rebuilt has its share (ResumableSampler); an iterable one when its dataset was split.
        stream = isinstance(loader.dataset, IterableDataset)
        sharded = rebuilt is not None and not (stream and rebuilt.dataset is loader.dataset)
        if not sharded and self.world_size > 1:
            rebuilt = self.strategy.process_dataloader(loader if rebuilt is None else rebuilt)
        wrapped = RigDataLoader(
            rebuilt if rebuilt is not None else loader,
            device=self.device,
            seed=seed,
            on_batch=self._batch_from,
            strategy=self.strategy,
        )
        return wrapped

    def _batch_from(self, loader: RigDataLoader) -> None:
        """``on_batch`` of the loaders this Rig prepares: ``loader`` has just yielded a batch."""
        self.current_loader = loader

    # -- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` through the precision (scaled under 16-mixed)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"rig.backward(loss) takes the loss tensor; got {type(loss).__name__}")
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

    # -- checkpoints -----------------------------------------------------------------------
    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = ...,
        link: str | None = ...,
        blocking: Literal[True] = ...,
    ) -> Path | CheckpointURL: ...

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = ...,
        link: str | None = ...,
        blocking: Literal[False],
    ) -> SaveHandle: ...

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = ...,
        link: str | None = ...,
        blocking: bool,
    ) -> Path | CheckpointURL | SaveHandle: ...

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = None,
        link: str | None = "last",
        blocking: bool = True,
    ) -> Path | CheckpointURL | SaveHandle:
        """Save ``state`` atomically to the checkpoint directory ``path`` (see :mod:`torchrig.checkpoint`).

        ``blocking=False`` returns a :class:`~torchrig.checkpoint.SaveHandle` once a snapshot is
        taken; the files are written in the background (docs/checkpoints.md, "Async saves").
        """
        saved = checkpoint.save(self, path, state, keep_last=keep_last, link=link, blocking=blocking)
        if not isinstance(saved, SaveHandle):
            self.strategy.record_progress()  # for the crash-loop check of torchrun restarts
        else:
            saved.add_commit_hook(lambda _: self.strategy.record_progress())
        return saved

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        prepare: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into the objects of ``state`` in place; returns what is left over.
        ``prepare(values)`` runs once the files are checked, before any object is compared or
        loaded (see :func:`torchrig.checkpoint.load`)."""
        return checkpoint.load(self, path, state, strict=strict, prepare=prepare)


def _run_launched(rig: Rig, fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    """What ``Rig.launch`` runs in every process: join the process group, then ``fn(rig, ...)``."""
    if not rig._launched:
        rig.strategy.setup_environment()
        rig._launched = True
    return None if fn is None else fn(rig, *args, **kwargs)


def _replaced_params(before: list[nn.Parameter], after: list[nn.Parameter]) -> dict[int, nn.Parameter]:
    """Parameters that setting up a module replaced by new objects (materialising ``meta``)."""
    if len(before) != len(after):
        return {}
    return {id(b): a for b, a in zip(before, after, strict=True) if b is not a}


def _rebind_params(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter]) -> None:
    # An optimizer built over the old objects would otherwise step tensors nobody uses.
    if not replaced:
        return
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in replaced]:
        optimizer.state[replaced[id(old)]] = optimizer.state.pop(old)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give a module created on ``meta`` real storage on ``device`` and initialise it."""
    module.to_empty(device=device)
    reset_parameters(module)


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy and torch on the CPU and every device."""
    arguments.seed("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every device type as well
    os.environ["PYTHONHASHSEED"] = str(seed % 2**32)  # what Python accepts: a child fails to start otherwise
    return seed
