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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchrig.preemption import SignalWatch
from torchrig.trainer.callbacks import active_hooks, sparse_batch_end_hooks
from torchrig.trainer.metrics import MetricStore
from torchrig.trainer.module import TrainingModule
from torchrig.wrappers import RigModule

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer


@dataclass
class LogSink:
    """Where ``self.log`` writes inside one loop's block: the metric store, whether the block is
    a training step (``on_step``/``on_epoch`` defaults) and the name suffix (``/dataloader_idx_N``
    with several evaluation loaders)."""

    store: MetricStore
    in_step: bool = False
    suffix: str = ""


class RunState:
    """The objects of a Trainer's runs (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        rig = trainer.rig
        self.trainer = trainer
        self.prepared_module: RigModule | None = None
        self.prepared_loaders: dict[int, tuple[Any, Any]] = {}  # id(loader) -> (loader, prepared)
        self.train_loader: Any = None
        self.eval_loaders: dict[str, list[Any]] = {"validate": [], "test": [], "predict": []}
        self.train_metrics = MetricStore(device=rig.device, rig=rig)
        self.eval_metrics = MetricStore(device=rig.device, rig=rig)
        #: Where ``self.log`` writes now: set for a block by :meth:`log_into`.
        self.sink = LogSink(self.train_metrics)
        self.epoch_metrics: dict[str, torch.Tensor] = {}
        self.logged: dict[str, Any] = {}
        self.stage: str | None = None
        self.resumed = False
        self.resumed_from: Path | None = None  # the checkpoint this fit resumed from (resolved)
        self.checkpoint_dir: Path | None = None  # the default checkpoint folder, once chosen
        #: Notes stop signals during a fit and agrees on them across ranks (see torchrig.preemption).
        self.signals = SignalWatch(rig.strategy, ())
        self.started_at = time.monotonic()
        self.sparse_due = 0.0  # when the sparse batch-end hooks are next called (perf_counter)
        self.skip_backward_sync = False  # inside TrainingModule.no_backward_sync (manual optimization)
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

    def call_module(self, hook: str, *args: Any) -> Any:
        return getattr(self.require_module(), hook)(*args)

    def call_callbacks(self, event: str, *args: Any) -> None:
        trainer, module = self.trainer, self.require_module()
        for hook in self.hooks(event):
            hook(trainer, module, *args)

    def hooks(self, event: str) -> list[Callable[..., Any]]:
        """The callbacks' ``event`` methods to call, bound, in order (:func:`active_hooks`).

        Worked out once per event and run (see :meth:`refresh_hooks`), so an event nobody
        overrides costs no call at all, which matters for the per-batch ones.
        """
        found = self._hook_cache.get(event)
        if found is None:
            found = active_hooks(self.trainer.callbacks, event)
            profiler = self.trainer.profiler
            if profiler is not None:
                found = profiler.wrap_hooks(found)
            self._hook_cache[event] = found
        return found

    def sparse_batch_end(self) -> tuple[list[Callable[..., Any]], float]:
        """The ``on_train_batch_end`` methods called at most every ``interval`` seconds, and the
        interval (:func:`sparse_batch_end_hooks`); worked out once per run."""
        if self._sparse_cache is None:
            hooks, interval = sparse_batch_end_hooks(self.trainer.callbacks)
            profiler = self.trainer.profiler
            if profiler is not None:
                hooks = profiler.wrap_hooks(hooks)
            self._sparse_cache = hooks, interval
        return self._sparse_cache

    def refresh_hooks(self) -> None:
        """Forget the hook lists (``callbacks`` may have changed since the last run)."""
        self._hook_cache.clear()
        self._sparse_cache = None

    # -- loggers ------------------------------------------------------------------------------------
    def log_to_loggers(self, metrics: dict[str, Any]) -> None:
        """Send one row to every logger at the current global step (and keep it as ``logged_metrics``)."""
        self.logged = metrics
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
