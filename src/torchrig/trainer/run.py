"""``RunState``: what a Trainer's ``fit``/``validate``/``test``/``predict`` keep while they run.

The :class:`~torchrig.trainer.Trainer` holds the configuration (its arguments) and the values
users read (``current_epoch``, ``global_step``, ``callback_metrics``...). Its run
(:class:`torchrig.trainer.loops.Run`: this state and the loops, as its methods) holds the objects
the loops work with: the prepared module and loaders, the metric stores and where ``self.log``
writes (:meth:`RunState.log_into`), the callbacks' hook lists, the stop-signal watch and the
clocks. The entry points (:mod:`torchrig.trainer.stages`) read and change it through these
public members.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchrig.data import length_of
from torchrig.nested import batch_sizes
from torchrig.preemption import SignalWatch
from torchrig.trainer.callbacks import (
    EVENTS,
    TRANSFER_HOOKS,
    active_hooks,
    overrides,
    sparse_batch_end_hooks,
    with_trainer,
)
from torchrig.trainer.datamodule import DataModule
from torchrig.trainer.metrics import MetricStore
from torchrig.trainer.module import TrainingModule
from torchrig.wrappers import RigModule

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer


def num_batches(loader: Any, limit: int | float) -> int | float:
    """How many batches of ``loader`` a loop runs under ``limit_*_batches``."""
    length = length_of(loader)
    if isinstance(limit, int):
        return min(limit, length)
    if math.isinf(length):
        if limit == 1.0:
            return length
        raise ValueError(
            f"limit_*_batches={limit} is a fraction, but the dataloader has no length; give an int number of batches"
        )
    return int(length * limit)


@dataclass
class LogSink:
    """Where ``self.log`` writes inside one loop's block: the metric store, whether the block is
    a training step (``on_step``/``on_epoch`` defaults) and the name suffix (``/dataloader_idx_N``
    with several evaluation loaders)."""

    store: MetricStore
    in_step: bool = False
    suffix: str = ""
    #: The batch the loop is at (None outside a batch), set by the loops: the weight of a value
    #: logged without a ``batch_size`` in an epoch mean is its size, as Lightning infers it
    #: (:meth:`batch_size`, worked out only when a log call needs it).
    batch: Any = None
    _sized: tuple[Any, int] = (None, 1)  # the batch whose size was worked out last, and that size

    def batch_size(self) -> int:
        """The size of the current batch: the first dimension of its first tensor (1 outside a
        batch or for a batch without tensors, with a warning for the latter)."""
        batch, (sized, size) = self.batch, self._sized
        if batch is None:
            return 1
        if batch is sized:
            return size
        sizes = batch_sizes(batch)
        first = next(sizes, None)
        if first is None:
            warnings.warn(
                f"self.log could not infer the batch size from a batch of type {type(batch).__name__} "
                "(no tensor in it); its values count once in the epoch mean: pass self.log(..., batch_size=n)",
                stacklevel=4,
            )
        elif any(other != first for other in sizes):
            warnings.warn(
                f"self.log inferred the batch size {first} from the batch's first tensor, but its tensors "
                "differ in their first dimension: pass self.log(..., batch_size=n) to say which it is",
                stacklevel=4,
            )
        self._sized = (batch, first or 1)
        return first or 1


class RunState:
    """The objects of a Trainer's runs (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        rig = trainer.rig
        self.trainer = trainer
        self.prepared_module: RigModule | None = None
        self.prepared_loaders: dict[int, tuple[Any, Any]] = {}  # id(loader) -> (loader, prepared)
        self.train_loader: Any = None
        #: Makes the fit's training loader when first needed (see :meth:`ensure_train_loader`).
        self.pending_train: Callable[[], Any] | None = None
        #: Make the fit's training and validation loaders again (``reload_dataloaders_every_n_epochs``).
        self.reload_sources: tuple[Callable[[], Any], Callable[[], list[Any]]] | None = None
        self.eval_loaders: dict[str, list[Any]] = {"validate": [], "test": [], "predict": []}
        #: The run's datamodule, if any, and whether the fit's training loader was given to ``fit``
        #: (not asked of a ``train_dataloader()``, so changing a batch size cannot remake it).
        self.datamodule: Any = None
        self.train_given = False
        self.eval_given = False  # the same for a validate/test/predict run's loaders
        self.train_metrics = MetricStore(device=rig.device, rig=rig)
        self.eval_metrics = MetricStore(device=rig.device, rig=rig)
        #: Where ``self.log`` writes now: set for a block by :meth:`log_into`.
        self.sink = LogSink(self.train_metrics)
        self.epoch_metrics: dict[str, torch.Tensor] = {}
        self.logged: dict[str, Any] = {}  # the last row sent to the loggers
        #: Every value sent to the loggers in this run, the latest of each name (``logged_metrics``).
        self.logged_all: dict[str, Any] = {}
        #: ``callback_metrics`` and ``logged_metrics`` show the training's values (a fit, until
        #: the next run starts: Lightning forgets a run's values when the next one starts).
        self.shows_training = False
        self.stage: str | None = None
        self.sanity_checking = False  # the fit's sanity check is running
        self.given_callbacks: list[Any] | None = None  # the Trainer's callbacks, once a module added its own
        self.compiled: torch.nn.Module | None = None  # torch.compile(module) as given to this run, if so
        self.resumed = False
        self.resumed_from: Path | None = None  # the checkpoint this fit resumed from (resolved)
        self.checkpoint_dir: Path | None = None  # the default checkpoint folder, once chosen
        #: Notes stop signals during a fit and agrees on them across ranks (see torchrig.preemption).
        self.signals = SignalWatch(rig.strategy, ())
        self.started_at = time.monotonic()
        self.sparse_due = 0.0  # when the sparse batch-end hooks are next called (perf_counter)
        self.skip_backward_sync = False  # inside TrainingModule.no_backward_sync (manual optimization)
        self.is_last_batch = False  # the training batch being run is its epoch's last (trainer.is_last_batch)
        self.stop_held = False  # a stop was held back for min_epochs/min_steps this fit (said once)
        #: predict: gather and return the predictions (``trainer.predict(return_predictions=...)``)
        self.return_predictions = True
        #: predict: the loader being predicted and the dataset indices of its current batch (this process's)
        self.predict_dataloader_idx = 0
        self.predict_batch_indices: list[int] = []
        self._hook_cache: dict[str, list[Callable[..., Any]]] = {}
        self._sparse_cache: tuple[list[Callable[..., Any]], float] | None = None

    # -- where self.log writes ------------------------------------------------------------------
    @contextlib.contextmanager
    def log_into(self, store: MetricStore, *, in_step: bool = False, suffix: str = "") -> Iterator[LogSink]:
        """Inside the block ``self.log`` writes to ``store``; the previous sink comes back after it."""
        previous, self.sink = self.sink, LogSink(store, in_step, suffix)
        try:
            yield self.sink
        finally:
            self.sink = previous

    # -- the module and the callbacks ----------------------------------------------------------------
    def require_module(self) -> TrainingModule:
        module = self.trainer.module
        if module is None:
            raise RuntimeError("no module attached; call fit/validate/test/predict with a module first")
        return module

    def emit(self, event: str, *args: Any) -> None:
        """Call every hook of ``event`` (one of :data:`~torchrig.trainer.callbacks.EVENTS`) with
        the event's arguments: the callbacks' then the module's, as Lightning does."""
        for hook in self.hooks(event):
            hook(*args)

    def hooks(self, event: str, monitoring: bool | None = None) -> list[Callable[..., Any]]:
        """The hooks of ``event`` to call, in order, each taking the event's own arguments: the
        callbacks' overridden methods (:func:`active_hooks`, given ``trainer, module`` first),
        then the module's when it overrides it (or its default does something).

        Worked out once per event and run (see :meth:`refresh_hooks`), so an event nobody
        overrides costs no call at all, which matters for the per-batch ones. ``monitoring``
        (``on_train_epoch_end`` only): True: the callbacks that read the epoch's metrics
        (:attr:`Callback.monitors_epoch_metrics`), called after the module's hook; False: the
        others and the module's hook; None: all.
        """
        key = event if monitoring is None else f"{event}/{monitoring}"
        found = self._hook_cache.get(key)
        if found is None:
            found = self._resolve(event, monitoring)
            self._hook_cache[key] = found
        return found

    def _resolve(self, event: str, monitoring: bool | None) -> list[Callable[..., Any]]:
        trainer, module, kind = self.trainer, self.require_module(), EVENTS[event]
        callbacks = [cb for cb in trainer.callbacks if monitoring is None or cb.monitors_epoch_metrics is monitoring]
        bound = active_hooks(callbacks, event) if kind.callback else []
        own = kind.module and monitoring is not True and (kind.default or overrides(module, TrainingModule, event))
        profiler = trainer.profiler
        if profiler is not None:
            bound = profiler.wrap_hooks(bound)
        found = [with_trainer(hook, trainer, module) for hook in bound]
        if own:
            method = getattr(module, event)
            found += profiler.wrap_hooks([method]) if profiler is not None else [method]
        return found

    def transfer_hooks(self) -> list[Callable[..., Any]] | None:
        """The three batch-transfer hooks (``on_before_batch_transfer``,
        ``transfer_batch_to_device``, ``on_after_batch_transfer``) when the module or the
        datamodule overrides one of them, each the datamodule's where it overrides it (Lightning's
        choice, with a warning when both do); None when neither does (the loader moves batches)."""

        module, datamodule = self.require_module(), self.datamodule
        hooks: list[Callable[..., Any]] = []
        own = False
        for name in TRANSFER_HOOKS:
            mine = overrides(module, TrainingModule, name)
            theirs = isinstance(datamodule, DataModule) and overrides(datamodule, DataModule, name)
            if mine and theirs:
                warnings.warn(
                    f"{name} is overridden in both {type(module).__name__} and {type(datamodule).__name__}; "
                    "the datamodule's is used (as Lightning does)",
                    stacklevel=2,
                )
            hooks.append(getattr(datamodule if theirs else module, name))
            own = own or mine or theirs
        return hooks if own else None

    def sparse_batch_end(self) -> tuple[list[Callable[..., Any]], float]:
        """The ``on_train_batch_end`` methods called at most every ``interval`` seconds (taking
        the event's arguments), and the interval (:func:`sparse_batch_end_hooks`); worked out
        once per run."""
        if self._sparse_cache is None:
            hooks, interval = sparse_batch_end_hooks(self.trainer.callbacks)
            profiler = self.trainer.profiler
            if profiler is not None:
                hooks = profiler.wrap_hooks(hooks)
            trainer, module = self.trainer, self.require_module()
            self._sparse_cache = [with_trainer(hook, trainer, module) for hook in hooks], interval
        return self._sparse_cache

    def refresh_hooks(self) -> None:
        """Forget the hook lists (``callbacks`` may have changed since the last run)."""
        self._hook_cache.clear()
        self._sparse_cache = None

    # -- loggers ------------------------------------------------------------------------------------
    def log_to_loggers(self, metrics: dict[str, Any]) -> None:
        """Send one row to every logger at the current global step (and keep it as ``logged_metrics``)."""
        self.logged = metrics
        self.logged_all.update(metrics)  # (with the rows' ``epoch``, left out where it is read)
        step = self.trainer.fit_state.global_step
        for lg in self.trainer.loggers:
            lg.log_metrics(metrics, step=step)

    # -- what the loops ask --------------------------------------------------------------------------
    def has_validation(self) -> bool:
        module = self.require_module()
        overridden = type(module).validation_step is not TrainingModule.validation_step
        return overridden and bool(self.eval_loaders["validate"]) and self.trainer.limit_val_batches != 0

    def eval_limit(self, stage: str) -> int | float:
        tr = self.trainer
        return {"validate": tr.limit_val_batches, "test": tr.limit_test_batches}[stage]

    def val_check_batches(self, n: int | float) -> int | float:
        """Batches between validation checks in an epoch of ``n`` (``inf``: only at the epoch's end)."""
        interval = self.trainer.val_check_interval
        if isinstance(interval, int):
            if interval > n:
                raise ValueError(
                    f"val_check_interval={interval} batches, but an epoch has only {n} training batches; "
                    "use a smaller int, or a float fraction of the epoch"
                )
            return interval
        if math.isinf(n):
            if interval == 1.0:  # at the end of the epoch, whenever the loader's iterator ends
                return math.inf
            raise ValueError(
                f"val_check_interval={interval} is a fraction of the epoch, but the training dataloader has no "
                "length (an IterableDataset without __len__); give an int number of batches between checks"
            )
        return max(1, int(n * interval))

    def track_batch_indices(self) -> bool:
        """Whether predict records each batch's dataset indices: a prediction writer reads them."""
        from torchrig.trainer.prediction_writer import BasePredictionWriter

        return any(isinstance(cb, BasePredictionWriter) for cb in self.trainer.callbacks)

    def ensure_train_loader(self) -> None:
        """Ask for and prepare the fit's training loader now, if it is still to come: after
        ``configure_optimizers`` (Lightning's order), or within it, when it reads
        ``trainer.estimated_stepping_batches``."""
        if self.pending_train is not None:
            make, self.pending_train = self.pending_train, None
            self.train_loader = make()

    def reload_due(self, epoch: int) -> bool:
        """Whether the loaders are asked for again as ``epoch`` starts (every
        ``reload_dataloaders_every_n_epochs`` epochs; the first epoch's are the fit's own)."""
        every = self.trainer.reload_dataloaders_every_n_epochs
        return bool(every) and epoch > 0 and epoch % every == 0

    def reload_loaders(self) -> None:
        """Ask the datamodule (or module) for the fit's training and validation loaders again."""
        assert self.reload_sources is not None
        make_train, make_val = self.reload_sources
        self.train_loader = make_train()
        self.eval_loaders["validate"] = make_val()

    def reload_for_resume(self, epoch: int) -> None:
        """Before a checkpoint of ``epoch`` is loaded: the loaders the uninterrupted fit had in it
        (asked for at the last reload epoch), so the checkpoint's position goes into them. The
        draws from torch's RNG this makes (a shuffle seed) are not the uninterrupted fit's, and are
        undone; the seed comes back with the loader's state."""
        every = self.trainer.reload_dataloaders_every_n_epochs
        if every and epoch - epoch % every > 0:
            with torch.random.fork_rng(devices=[]):
                self.reload_loaders()

    def eval_context(self) -> contextlib.AbstractContextManager[Any]:
        """What validation, test and predict run under: ``torch.inference_mode()`` when
        ``Trainer(inference_mode=True)``, except under strategies that shard the module (FSDP2's
        and tensor parallel's parameters are re-made around each forward, which inference tensors
        cannot take part in), else ``torch.no_grad()``."""
        tr = self.trainer
        if tr.inference_mode and not tr.rig.strategy.sharded:
            return torch.inference_mode()
        return torch.no_grad()

    def time_is_up(self) -> bool:
        tr = self.trainer
        if tr.max_time is None:
            return False
        up = time.monotonic() - self.started_at >= tr.max_time
        return tr.rig.reduce_boolean_decision(up, all=False) if tr.rig.world_size > 1 else up
