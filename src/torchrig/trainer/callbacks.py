"""The Callback base and the events table: every hook a run calls, in the order it calls them.

A run calls Lightning 2.6's hooks with Lightning's names, arguments and order; at each event the
callbacks' methods run first (``method(trainer, module, *args)``, in the Trainer's order), then
the module's (``method(*args)``). :data:`EVENTS` lists them; docs/migrating.md has the table of
when each is called. torchrig's own evaluation events (``on_eval_start``, ``on_eval_batch_end``,
``on_eval_end``, with a ``stage`` argument: ``"sanity_check"``, ``"validate"``, ``"test"`` or
``"predict"``) are called for every evaluation loop too, right after the Lightning event of the
same moment.
``on_restore_optimizers`` (torchrig's own, callbacks only) is called when a fit resumes, after
the callbacks' ``load_state_dict`` and before the optimizers' and schedulers' state is loaded.

Every method does nothing by default; override the ones you need. ``state_dict`` /
``load_state_dict`` let a callback's state travel in checkpoints.

The Trainer calls only the methods a callback (or the module) overrides, worked out at the start
of each run (:func:`active_hooks`): a small model's step is short enough that each Python call
per batch shows in its speed. A callback says how often it wants an event with
:meth:`Callback.event_schedule` (an :class:`EventSchedule`), read at the start of each run: not
at all (``ModelCheckpoint`` saving at epoch ends has no per-batch work), or, for
``on_train_batch_end``, at most every so many seconds (the progress bar, which only shows
progress): it is then called at most that often and for the last batch the loop runs (the
epoch's last, or the one after which the fit stops), after that batch's validation, if any.

A method named like a hook (``on_...``) that no event calls is a warning when the run starts,
naming the nearest hook (:func:`unknown_hooks`): a typo would otherwise never run.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


@dataclass(frozen=True)
class Event:
    """Who has a hook for an event: callbacks (``Callback`` method, called with ``trainer,
    module`` first) and/or the module (``TrainingModule`` method); ``default`` when the module's
    own method does something (``on_validation_model_eval`` puts it in eval mode...), so it is
    called even when not overridden."""

    callback: bool = True
    module: bool = True
    default: bool = False


_BOTH, _CALLBACK, _MODULE, _DEFAULT = Event(), Event(module=False), Event(callback=False), Event(False, True, True)

#: Every event a run calls (Lightning 2.6's names), in the order docs/migrating.md tabulates them.
EVENTS: dict[str, Event] = {
    "setup": _BOTH,
    "on_fit_start": _BOTH,
    "on_sanity_check_start": _CALLBACK,
    "on_validation_model_zero_grad": _DEFAULT,
    "on_validation_model_eval": _DEFAULT,
    "on_validation_start": _BOTH,
    "on_validation_epoch_start": _BOTH,
    "on_validation_batch_start": _BOTH,
    "on_validation_batch_end": _BOTH,
    "on_validation_epoch_end": _BOTH,
    "on_validation_end": _BOTH,
    "on_validation_model_train": _DEFAULT,
    "on_sanity_check_end": _CALLBACK,
    "on_train_start": _BOTH,
    "on_train_epoch_start": _BOTH,
    "on_train_batch_start": _BOTH,
    "on_before_zero_grad": _BOTH,
    "on_before_backward": _BOTH,
    "on_after_backward": _BOTH,
    "on_before_optimizer_step": _BOTH,
    "on_train_batch_end": _BOTH,
    "on_train_epoch_end": _BOTH,
    "on_train_end": _BOTH,
    "on_fit_end": _BOTH,
    "on_test_model_eval": _DEFAULT,
    "on_test_start": _BOTH,
    "on_test_epoch_start": _BOTH,
    "on_test_batch_start": _BOTH,
    "on_test_batch_end": _BOTH,
    "on_test_epoch_end": _BOTH,
    "on_test_end": _BOTH,
    "on_test_model_train": _DEFAULT,
    "on_predict_model_eval": _DEFAULT,
    "on_predict_start": _BOTH,
    "on_predict_epoch_start": _BOTH,
    "on_predict_batch_start": _BOTH,
    "on_predict_batch_end": _BOTH,
    "on_predict_epoch_end": _BOTH,
    "on_predict_end": _BOTH,
    "on_eval_start": _CALLBACK,
    "on_eval_batch_end": _CALLBACK,
    "on_eval_end": _CALLBACK,
    "on_save_checkpoint": _BOTH,
    "on_load_checkpoint": _BOTH,
    "on_restore_optimizers": _CALLBACK,
    "on_exception": _CALLBACK,
    "teardown": _BOTH,
}

#: The module's hooks around the move of a batch to the device (called, all three, only when the
#: module overrides one of them; otherwise the loader moves the batch itself).
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")

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

    #: True: this callback's ``on_train_epoch_end`` runs after the module's, once the epoch's
    #: metrics are reduced (Lightning's "monitoring" callbacks: checkpointing, early stopping);
    #: the others' run before the module's, as in Lightning.
    monitors_epoch_metrics: ClassVar[bool] = False

    def event_schedule(self, event: str) -> EventSchedule:
        """How often this callback wants ``event`` (the name of one of its methods, such as
        ``"on_train_batch_end"``), as configured: an :class:`EventSchedule`. The Trainer asks at
        the start of each run, for the events the callback overrides. Default: every time."""
        return EVERY_TIME

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None: ...

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None: ...

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_predict_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_before_backward(self, trainer: Trainer, module: TrainingModule, loss: torch.Tensor) -> None: ...

    def on_after_backward(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Any) -> None: ...

    def on_before_zero_grad(self, trainer: Trainer, module: TrainingModule, optimizer: Any) -> None: ...

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """torchrig's: before every evaluation loop (``stage``: sanity_check/validate/test/predict)."""

    def on_eval_batch_end(
        self, trainer: Trainer, module: TrainingModule, stage: str, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """torchrig's: after each batch of every evaluation loop."""

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """torchrig's: after an evaluation loop, its metrics computed."""

    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None: ...

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None: ...

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None: ...

    def on_restore_optimizers(self, trainer: Trainer, module: TrainingModule) -> None:
        """torchrig's own: a fit resuming from a checkpoint calls it once every callback's state
        is loaded, before the optimizers' and schedulers' state is: a callback that changed them
        during the saved run (parameter groups added, a scheduler swapped in) makes them so again
        here, so that the saved state loads into them (:class:`~torchrig.BaseFinetuning` re-adds
        its parameter groups)."""

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


def merge_callbacks(given: list[Callback], extra: Any) -> list[Callback]:
    """The callbacks of a run: the Trainer's (``given``) and what the module's
    ``configure_callbacks()`` returned (``extra``: a callback or a list), which replace the
    Trainer's of the same type, as in Lightning."""
    added = [extra] if isinstance(extra, Callback) else list(extra or [])
    for cb in added:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"configure_callbacks() returned {type(cb).__name__}; return a torchrig.Callback or a list of them"
            )
    types = {type(cb) for cb in added}
    return [cb for cb in given if type(cb) not in types] + added


def overrides(obj: Any, base: type, name: str) -> bool:
    """Whether ``obj`` overrides ``base``'s method ``name`` (on its class or the instance)."""
    default = getattr(base, name)
    return name in getattr(obj, "__dict__", ()) or getattr(type(obj), name, default) is not default


def with_trainer(hook: Callable[..., Any], trainer: Trainer, module: TrainingModule) -> Callable[..., Any]:
    """A callback's hook as the loops call every hook: with the event's own arguments only."""
    return functools.partial(hook, trainer, module)


def unknown_hooks(obj: Any, base: type) -> list[str]:
    """One line per method of ``obj`` named like a hook (``on_...``) that ``base`` does not have,
    so no event calls it: its name, where it is defined and the nearest known hook."""
    known = sorted(n for n in dir(base) if n.startswith("on_"))
    lines = []
    for name in sorted(n for n in dir(type(obj)) if n.startswith("on_") and n not in known):
        if not callable(getattr(type(obj), name, None)):
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}?" if near else "no hook has a similar name (docs/migrating.md lists them)"
        lines.append(f"{type(obj).__name__}.{name} is not a hook torchrig calls, so it never runs; {hint}")
    return lines


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
    if not overrides(cb, Callback, event):
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
