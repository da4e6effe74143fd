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

    Names are Lightning's: the ``name`` of the optimizer's scheduler config (``{"scheduler": s,
    "name": "my_lr"}``), else ``lr-<Optimizer>`` (``-<i>`` for a repeated class); with several
    parameter groups ``/<group name>`` or ``/pg<i>`` (from 1) after it, and ``-momentum`` after
    each for the momentum (Adam's ``beta1``; 0 for an optimizer without one).

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
        configs = trainer.lr_scheduler_configs
        named = {id(getattr(cfg.scheduler, "optimizer", None)): cfg.name for cfg in configs if cfg.name}
        for opt in trainer.optimizers:
            inner = getattr(opt, "optimizer", opt)
            cls = type(inner).__name__
            seen[cls] = seen.get(cls, -1) + 1
            base = named.get(id(inner)) or named.get(id(opt)) or f"lr-{cls}" + (f"-{seen[cls]}" if seen[cls] else "")
            groups = opt.param_groups
            for i, group in enumerate(groups):
                label = group.get("name", f"pg{i + 1}") if len(groups) > 1 else group.get("name")
                name = f"{base}/{label}" if label else base
                values[name] = float(group["lr"])
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                    values[f"{name}-momentum"] = float(momentum)
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
