"""Callbacks that log what the run is doing: learning rates and device statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


def _log(trainer: Trainer, values: dict[str, float]) -> None:
    if values:
        for lg in trainer.loggers:
            lg.log_metrics(dict(values), step=trainer.global_step)


class _EveryNSteps(Callback):
    """Acts once per optimizer step, every ``log_every_n_steps`` steps."""

    def __init__(self) -> None:
        self._last_step = -1

    def _due(self, trainer: Trainer) -> bool:
        step = trainer.global_step
        if step == self._last_step or step % trainer.log_every_n_steps:
            return False
        self._last_step = step
        return True


class LearningRateMonitor(_EveryNSteps):
    """Logs each optimizer's learning rate (per parameter group) to the loggers.

    Names are ``lr-<Optimizer>`` (``/pg<i>`` per extra group, ``-<i>`` for a repeated class).

    Args:
        logging_interval: ``"step"`` (every ``log_every_n_steps`` steps) or ``"epoch"``.
        log_momentum: also log ``momentum`` (or Adam's ``beta1``).

    Example:
        >>> # Trainer(callbacks=[LearningRateMonitor(logging_interval="epoch")])
    """

    def __init__(self, *, logging_interval: str = "step", log_momentum: bool = False) -> None:
        super().__init__()
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"LearningRateMonitor(logging_interval={logging_interval!r}); use 'step' or 'epoch'")
        self.logging_interval, self.log_momentum = logging_interval, log_momentum
        self.last_values: dict[str, float] = {}

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.logging_interval == "step" and self._due(trainer):
            self._record(trainer)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.logging_interval == "epoch":
            self._record(trainer)

    def _record(self, trainer: Trainer) -> None:
        values: dict[str, float] = {}
        seen: dict[str, int] = {}
        for opt in trainer.optimizers:
            cls = type(getattr(opt, "optimizer", opt)).__name__
            seen[cls] = seen.get(cls, -1) + 1
            base = f"lr-{cls}" + (f"-{seen[cls]}" if seen[cls] else "")
            for i, group in enumerate(opt.param_groups):
                name = base if i == 0 else f"{base}/pg{i + 1}"
                values[name] = float(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", group.get("betas", (None,))[0])
                    if momentum is not None:
                        values[name.replace("lr-", "momentum-", 1)] = float(momentum)
        self.last_values = values
        _log(trainer, values)


class DeviceStatsMonitor(_EveryNSteps):
    """Logs the accelerator's ``get_device_stats`` (memory, utilisation) every ``log_every_n_steps``.

    Only numeric statistics are logged, as ``device_stats/<name>``. Reading the statistics is a
    host-side query, done only on the logging steps.

    Example:
        >>> # Trainer(callbacks=[DeviceStatsMonitor()], log_every_n_steps=10)
    """

    def __init__(self) -> None:
        super().__init__()
        self.last_values: dict[str, float] = {}

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._due(trainer):
            return
        stats = trainer.rig.accelerator.get_device_stats(trainer.rig.device)
        values = {
            f"device_stats/{k}": float(v)
            for k, v in stats.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self.last_values = values
        _log(trainer, values)
