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
shows in its speed. A callback says how often it wants an event with
:meth:`Callback.event_schedule` (an :class:`EventSchedule`), read at the start of each run: not
at all (``ModelCheckpoint`` saving at epoch ends has no per-batch work), or, for
``on_train_batch_end``, at most every so many seconds (the progress bar, which only shows
progress): it is then called at most that often and for the last batch the loop runs (the
epoch's last, or the one after which the fit stops), after that batch's validation, if any.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

#: The one event that can be thinned to at most every ``EventSchedule.seconds``.
THINNED_EVENT = "on_train_batch_end"


@dataclass(frozen=True)
class EventSchedule:
    """How often a callback wants one of its events (the answer of :meth:`Callback.event_schedule`).

    Args:
        seconds: None (default): at every such event. A number of seconds (``>= 0``, ``math.inf``
            allowed), for ``on_train_batch_end`` only: at most that often, and always for the last
            batch the loop runs (the epoch's last, or the one after which the fit stops); such
            calls come after the batch's validation, if any, and callbacks thinned this way are
            called together, at the shortest of their intervals.
        enabled: False: not at all (the callback has nothing to do at this event as configured).

    Example:
        >>> class Draw(Callback):
        ...     def event_schedule(self, event):
        ...         return EventSchedule(seconds=1.0) if event == "on_train_batch_end" else EventSchedule()
        ...     def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        ...         print("at batch", batch_idx)
    """

    seconds: float | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        s = self.seconds
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0):
            raise ValueError(f"EventSchedule(seconds={s!r}): give a number of seconds >= 0 (math.inf allowed) or None")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"EventSchedule(enabled={self.enabled!r}) must be True or False")


#: The default schedule: every event.
EVERY_TIME = EventSchedule()


class Callback:
    """Base class of Trainer callbacks (see the module docstring for the events).

    Example:
        >>> class PrintEpoch(Callback):
        ...     def on_train_epoch_end(self, trainer, module):
        ...         print("epoch", trainer.current_epoch, "done")
    """

    def event_schedule(self, event: str) -> EventSchedule:
        """How often this callback wants ``event`` (the name of one of its methods, such as
        ``"on_train_batch_end"``), as configured: an :class:`EventSchedule`. The Trainer asks at
        the start of each run, for the events the callback overrides. Default: every time."""
        return EVERY_TIME

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
    overridden ones that want every event (:meth:`Callback.event_schedule`); those thinned to at
    most every so many seconds are :func:`sparse_batch_end_hooks`."""
    return [getattr(cb, event) for cb in callbacks if _schedule(cb, event) is EVERY_TIME]


def sparse_batch_end_hooks(callbacks: Sequence[Callback]) -> tuple[list[Callable[..., Any]], float]:
    """The ``on_train_batch_end`` methods of the callbacks that want it at most every so many
    seconds, and the shortest of those intervals (they are called together)."""
    hooks, intervals = [], []
    for cb in callbacks:
        schedule = _schedule(cb, THINNED_EVENT)
        if schedule is not None and schedule.seconds is not None:
            intervals.append(float(schedule.seconds))
            hooks.append(cb.on_train_batch_end)
    return hooks, min(intervals, default=math.inf)


def _schedule(cb: Callback, event: str) -> EventSchedule | None:
    """When ``cb`` overrides ``event`` (on its class or the instance) and wants it: its
    schedule (:data:`EVERY_TIME` for every event); else None."""
    base = getattr(Callback, event)
    if not (event in getattr(cb, "__dict__", ()) or getattr(type(cb), event, base) is not base):
        return None
    schedule = cb.event_schedule(event)
    if not isinstance(schedule, EventSchedule):
        raise TypeError(
            f"{type(cb).__name__}.event_schedule({event!r}) returned {type(schedule).__name__}; "
            "return a torchrig.trainer.callbacks.EventSchedule"
        )
    if not schedule.enabled:
        return None
    if schedule.seconds is not None and event != THINNED_EVENT:
        raise ValueError(
            f"{type(cb).__name__}.event_schedule({event!r}) returned seconds={schedule.seconds}; only "
            f"{THINNED_EVENT} can be called at most every so many seconds (use EventSchedule() or enabled=False)"
        )
    return EVERY_TIME if schedule == EVERY_TIME else schedule
