"""``EarlyStopping``: stop a fit when a logged metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torchrig import arguments
from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved for ``patience`` checks.

    It checks when Lightning's does: at each training epoch's end, once the epoch's metrics are
    reduced, when validation runs at every epoch's end or not at all; after each validation when
    it runs several times an epoch or every few epochs (``check_on_train_epoch_end`` True or
    False chooses). Every process stops together: the decision goes through
    ``rig.reduce_boolean_decision`` (one process asking to stop stops all).

    Args:
        monitor: the logged metric to watch.
        mode: ``"min"`` or ``"max"``: which direction is an improvement.
        patience: checks without improvement before stopping.
        min_delta: the least change that counts as an improvement.
        check_finite: stop as soon as the metric is NaN or infinite.
        strict: raise when ``monitor`` was not logged (else skip the check).
        check_on_train_epoch_end: check at the end of each training epoch (True) or after each
            validation (False); None: as Lightning decides (above), for each fit.

    Example:
        >>> stopper = EarlyStopping(monitor="val_loss", patience=2)
        >>> # Trainer(callbacks=[stopper]).fit(...); stopper.stopped_epoch
    """

    monitors_epoch_metrics = True  # on_train_epoch_end after the module's, once the epoch's metrics are in

    def __init__(
        self,
        *,
        monitor: str,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
        strict: bool = True,
        check_on_train_epoch_end: bool | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}); use 'min' or 'max'")
        arguments.int_in_range("patience", patience, 0)
        if min_delta < 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}) must be >= 0 (the direction comes from mode=)")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.check_finite, self.strict, self.check_on_train_epoch_end = check_finite, strict, check_on_train_epoch_end
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = -1
        self.stop_reason = ""

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        # Only validations inside a fit count (not its sanity check, nor Trainer.validate).
        if trainer.run.stage != "fit" or trainer.sanity_checking:
            return
        if not at_epoch_end(trainer, self.check_on_train_epoch_end):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if at_epoch_end(trainer, self.check_on_train_epoch_end):
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            if self.strict:
                raise ValueError(
                    f"EarlyStopping(monitor={self.monitor!r}) found no such logged metric; logged: "
                    f"{sorted(metrics) or 'none'}. Log it, or pass strict=False to skip checks without it"
                )
            return
        stop, reason = self.evaluate(float(metrics[self.monitor]))
        if trainer.rig.reduce_boolean_decision(stop, all=False):
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stop_reason = reason or "another process asked to stop"
            trainer.rig.print(f"EarlyStopping: {self.stop_reason}")

    def evaluate(self, value: float) -> tuple[bool, str]:
        """Update the state with a new ``value``; whether to stop, and why."""
        if self.check_finite and not math.isfinite(value):
            return True, f"{self.monitor}={value} is not finite"
        better = (
            value < self.best_score - self.min_delta if self.mode == "min" else value > self.best_score + self.min_delta
        )
        if better:
            self.best_score, self.wait_count = value, 0
            return False, ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"{self.monitor} did not improve for {self.wait_count} checks (best {self.best_score:.6g})")
        return False, ""

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = int(state["wait_count"])
        self.best_score = float(state["best_score"])
        self.stopped_epoch = int(state["stopped_epoch"])


def at_epoch_end(trainer: Trainer, given: bool | None) -> bool:
    """Whether a callback that reads the validation's metrics (EarlyStopping, ModelCheckpoint)
    acts at each training epoch's end rather than after each validation: ``given``, or, when
    None, Lightning's rule: at the epoch's end when the fit validates at every epoch's end (its
    metrics then also hold the epoch's training means) or never; after each validation when it
    validates several times an epoch or every few epochs (the epochs between have no new values)."""
    if given is not None:
        return given
    if trainer.check_val_every_n_epoch != 1:
        return False
    return trainer.val_check_interval == 1.0 or not trainer.run.has_validation()
