"""``Timer``: stop a fit after a wall-clock budget (Lightning's ``Timer`` callback), across resumes.

The time a fit has trained is kept in the callback's state, so a resumed fit goes on counting
from where the checkpoint left it: three runs of one hour each under ``Timer("00:02:30:00")``
stop half-way through the third. When the budget is spent the Timer asks the fit to stop
(``trainer.should_stop``, agreed by every process), at the next optimizer step or epoch end;
the fit then ends as any stopped fit does: :class:`ModelCheckpoint` saves ``last``.
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Any

from torchrig.trainer import settings
from torchrig.trainer.callbacks import Callback, EventSchedule

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

_STAGES = ("train", "validate", "test", "predict")


class Timer(Callback):
    """Measure the time each stage runs; stop the fit once ``duration`` has been trained.

    Args:
        duration: the training budget: seconds, a ``datetime.timedelta``, a dict of its
            arguments (``{"hours": 2}``) or ``"DD:HH:MM:SS"``; None measures only.
        interval: check after every optimizer step (``"step"``) or at each epoch's end (``"epoch"``).
        verbose: say when the budget stops the fit.

    ``time_elapsed(stage)`` (``"train"``, ``"validate"``, ``"test"``, ``"predict"``),
    ``time_remaining(stage)``, ``start_time(stage)`` and ``end_time(stage)`` read the clocks.

    Example:
        >>> # trainer = torchrig.Trainer(callbacks=[torchrig.Timer(duration="00:12:00:00")])
    """

    def __init__(
        self,
        duration: str | float | datetime.timedelta | dict[str, int] | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if isinstance(duration, dict):
            try:
                duration = datetime.timedelta(**duration)
            except TypeError as err:
                raise ValueError(f"Timer(duration={duration!r}): {err}; use datetime.timedelta's names") from None
        self.duration = settings.parse_time(duration, name="duration")
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer(interval={interval!r}); use 'step' or 'epoch'")
        self.interval = interval
        self.verbose = settings.flag("verbose", verbose)
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset: dict[str, float] = dict.fromkeys(_STAGES, 0.0)  # time from earlier runs (resume)

    # -- the clocks ---------------------------------------------------------------------------------
    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (``time.monotonic()``), None if it has not."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended, None while it runs or before it ran."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds ``stage`` has run, counting earlier runs of a resumed fit."""
        stage = _stage(stage)
        start, end = self._start[stage], self._end[stage]
        now = time.monotonic() if end is None else end
        return self._offset[stage] + (0.0 if start is None else now - start)

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of ``duration`` (None without one)."""
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    def _begin(self, stage: str, resumed: bool = False) -> None:
        if not resumed:  # a resumed fit goes on from the time its checkpoint recorded
            self._offset[stage] = 0.0
        self._start[stage], self._end[stage] = time.monotonic(), None

    def _finish(self, stage: str) -> None:
        if self._start[stage] is not None and self._end[stage] is None:
            self._end[stage] = time.monotonic()

    # -- Trainer events ------------------------------------------------------------------------
    def event_schedule(self, event: str) -> EventSchedule:
        if event == "on_train_batch_end":
            return EventSchedule(enabled=self.duration is not None and self.interval == "step")
        if event == "on_train_epoch_end":
            return EventSchedule(enabled=self.duration is not None and self.interval == "epoch")
        return EventSchedule()

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._begin("train", resumed=trainer.run.resumed)
        if self.duration is not None:
            self._check(trainer)  # a resumed fit whose budget is spent trains nothing more

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._finish("train")

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._finish("train")

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "sanity_check":
            self._begin(stage)

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "sanity_check":
            self._finish(stage)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        assert self.duration is not None
        up = self.time_elapsed("train") >= self.duration
        if trainer.world_size > 1:  # every process stops at the same step
            up = trainer.rig.reduce_boolean_decision(up, all=False)
        if up and not trainer.should_stop:
            trainer.should_stop = True
            if self.verbose:
                spent = datetime.timedelta(seconds=round(self.time_elapsed("train")))
                budget = datetime.timedelta(seconds=self.duration)
                trainer.rig.print(
                    f"torchrig: Timer: trained {spent} of {budget}; stopping at step {trainer.global_step}"
                )

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in _STAGES}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        elapsed = state.get("time_elapsed", {})
        self._offset["train"] = float(elapsed.get("train", 0.0))
        self._start["train"] = self._end["train"] = None


def _stage(stage: str) -> str:
    if stage not in _STAGES:
        raise ValueError(f"Timer: stage={stage!r}; use one of {', '.join(map(repr, _STAGES))}")
    return stage
