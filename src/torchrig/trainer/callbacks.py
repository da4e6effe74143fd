"""The Callback base: the events a Trainer emits, in the order it emits them.

| event                    | when                                                      |
|--------------------------|-----------------------------------------------------------|
| on_fit_start             | after set-up, before the first (sanity) validation/epoch  |
| on_train_epoch_start     | before the first batch of each training epoch             |
| on_train_batch_end       | after each optimizer step (or accumulation micro-batch)   |
| on_train_epoch_end       | after the last batch of each training epoch               |
| on_eval_start            | before validate/test/predict/sanity loops (``stage``)     |
| on_eval_batch_end        | after each evaluation batch                               |
| on_eval_end              | after an evaluation loop, metrics computed                |
| on_validation_end        | after validation metrics are computed (checkpointing, early stopping) |
| on_save_checkpoint       | a checkpoint dict is being written: add your state        |
| on_load_checkpoint       | a checkpoint dict was read: restore your state            |
| on_exception             | the run raised (including KeyboardInterrupt)              |
| on_fit_end               | the fit finished (also after early stopping)              |

Every method does nothing by default; override the ones you need. ``state_dict`` /
``load_state_dict`` let a callback's state travel in checkpoints.

The Trainer calls only the methods a callback overrides, worked out at the start of each run
(:func:`active_hooks`): a small model's step is short enough that each Python call per batch
shows in its speed. Two class attributes, read at the start of each run, let a callback skip
more of them: ``_idle_events``, the overridden events that have nothing to do as configured
(``ModelCheckpoint`` saving at epoch ends has no per-batch work), and
``_train_batch_end_interval``, for a callback that only shows progress (the progress bar):
its ``on_train_batch_end`` is then called at most every that many seconds and for the last
batch the loop runs (the epoch's last, or the one after which the fit stops), not after every
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


class Callback:
    """Base class of Trainer callbacks (see the module docstring for the events).

    Example:
        >>> class PrintEpoch(Callback):
        ...     def on_train_epoch_end(self, trainer, module):
        ...         print("epoch", trainer.current_epoch, "done")
    """

    @property
    def _idle_events(self) -> tuple[str, ...]:
        """Events this callback overrides that have nothing to do as configured (not called)."""
        return ()

    @property
    def _train_batch_end_interval(self) -> float | None:
        """Seconds: ``on_train_batch_end`` at most this often (and for the loop's last batch);
        None: after every batch."""
        return None

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None: ...

    def on_eval_batch_end(
        self, trainer: Trainer, module: TrainingModule, stage: str, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None: ...

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None: ...

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None: ...

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def checkpoint_modules(self, trainer: Trainer) -> dict[str, nn.Module]:
        """Modules whose tensors this callback keeps in checkpoints (``{name: module}``, entry
        ``<state_key>.<name>``), saved like the trained module's weights (safetensors files; DCP
        shards under FSDP) and loaded into them in place on resume (before ``on_fit_start``).
        For large tensors, which ``state_dict`` values are not meant for (under FSDP those go
        into rank zero's ``state.pt``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint (class name, unique per type)."""
        return type(self).__qualname__


def active_hooks(callbacks: Sequence[Callback], event: str) -> list[Callable[..., Any]]:
    """The ``event`` methods of ``callbacks`` to call at every such event, bound, in order: the
    overridden ones, less the idle ones (``_idle_events``) and, for ``on_train_batch_end``,
    those of callbacks called sparsely (see :func:`sparse_batch_end_hooks`)."""
    return [
        getattr(cb, event)
        for cb in callbacks
        if _acts_on(cb, event) and not (event == "on_train_batch_end" and cb._train_batch_end_interval is not None)
    ]


def sparse_batch_end_hooks(callbacks: Sequence[Callback]) -> tuple[list[Callable[..., Any]], float]:
    """The ``on_train_batch_end`` methods of the callbacks that ask to be called at most every
    ``_train_batch_end_interval`` seconds, and the shortest of those intervals (they are called
    together)."""
    hooks, intervals = [], []
    for cb in callbacks:
        interval = cb._train_batch_end_interval
        if interval is not None:
            intervals.append(float(interval))
            if _acts_on(cb, "on_train_batch_end"):
                hooks.append(cb.on_train_batch_end)
    return hooks, min(intervals, default=0.0)


def _acts_on(cb: Callback, event: str) -> bool:
    """Whether ``cb`` overrides ``event`` (on its class or the instance) and does not call it idle."""
    base = getattr(Callback, event)
    overridden = event in getattr(cb, "__dict__", ()) or getattr(type(cb), event, base) is not base
    return overridden and event not in cb._idle_events
