"""What :meth:`Rig.prepare <torchrig.Rig.prepare>` does to each kind of object, and
:meth:`~torchrig.Rig.setup_dataloader`: a module gets the precision, the speed-ups, real storage
when it was made on ``meta`` and the strategy's wrapping; an optimizer follows the parameters the
strategy replaced and steps through the precision; a dataloader gets each process's share
(a resumable sampler or a split stream) and yields batches on the device.

:class:`Preparing` is a base class of :class:`~torchrig.Rig` (``rig.py``), which holds the plan
and the bookkeeping these methods read and write.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from torchrig import speedups
from torchrig.data import (
    RigDataLoader,
    loader_kwargs,
    order_sampler,
    rebuild_iterable,
    rebuild_with_sampler,
    sampler_generator,
)
from torchrig.precision import check_optimizer_eps
from torchrig.strategies import Strategy
from torchrig.strategies.base import reset_parameters
from torchrig.strategies.launch import launch_first
from torchrig.wrappers import RigModule, RigOptimizer, as_prepared, wrap_optimizer

if TYPE_CHECKING:
    import weakref

    from torchrig.precision import Precision


class Preparing:
    """``prepare`` and ``setup_dataloader`` of :class:`~torchrig.Rig`."""

    if TYPE_CHECKING:  # what the Rig holds (rig.py)
        current_loader: RigDataLoader | None
        _launched: bool
        _prepared: weakref.WeakValueDictionary[int, Any]
        _compile: speedups.Compile | None
        _activation_checkpointing: speedups.ActivationCheckpointing | None
        backwards_unstepped: int

        @property
        def strategy(self) -> Strategy: ...
        @property
        def precision(self) -> Precision: ...
        @property
        def device(self) -> torch.device: ...
        @property
        def world_size(self) -> int: ...

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
        optimizer.register_step_post_hook(self._stepped)
        for state in optimizer.state.values():  # state created before prepare follows the params
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(self.device)
        return wrap_optimizer(optimizer, self.precision)

    def _stepped(self, *_: Any) -> None:
        """A prepared optimizer stepped: the gradients accumulated so far are in the weights."""
        self.backwards_unstepped = 0

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
        replicas, rank = self.strategy.data_parallel_size, self.strategy.data_parallel_rank
        if not use_distributed_sampler:  # (a stream here is taken to be split already: one share a process)
            return RigDataLoader(
                loader, device=self.device, on_batch=self._batch_from, strategy=self.strategy, shares=replicas
            )
        # The shuffle seed comes from torch's RNG (so seed_everything fixes it) and rank 0 decides;
        # a loader that does not shuffle takes no draw (the run's RNG stream is the hand-written loop's).
        # A RandomSampler with a generator (DataLoader(shuffle=True, generator=g)) keeps drawing its order
        # from it, as in the hand-written loop: no seed is drawn, and under several processes rank 0's
        # state of it becomes every rank's, so the ranks split one order.
        generator = sampler_generator(loader)
        shuffles = type(order_sampler(loader)) is RandomSampler and generator is None
        seed = self.strategy.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item())) if shuffles else 0
        pin = self.device.type not in ("cpu", "mps")
        if generator is not None and self.world_size > 1:
            generator.set_state(self.strategy.broadcast({"state": generator.get_state()})["state"])
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
        return RigDataLoader(
            rebuilt if rebuilt is not None else loader,
            device=self.device,
            seed=seed,
            on_batch=self._batch_from,
            strategy=self.strategy,
            shares=replicas if sharded else 1,  # (a stream's; each process reads an unsplit one whole)
        )

    def _batch_from(self, loader: RigDataLoader) -> None:
        """``on_batch`` of the loaders this Rig prepares: ``loader`` has just yielded a batch."""
        self.current_loader = loader


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
