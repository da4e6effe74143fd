"""What ``configure_optimizers()`` returns, parsed: the optimizers and, for each scheduler, a
:class:`SchedulerConfig` (when the Trainer steps it), as Lightning reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau


@dataclass
class SchedulerConfig:
    """One LR scheduler and when the Trainer steps it."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    #: What ``LearningRateMonitor`` logs its optimizer's learning rate as (Lightning's ``name``).
    name: str | None = None
    #: A ``monitor`` that was not logged is an error (False: a warning, and the step is skipped).
    strict: bool = True


def parse_optimizers(
    config: Any, steps_schedulers: bool = False
) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """The optimizers and schedulers of what ``configure_optimizers()`` returned.

    ``steps_schedulers``: the module overrides ``lr_scheduler_step``, so a scheduler need not be
    torch's (timm's, for one)."""
    if isinstance(config, torch.optim.Optimizer):
        return [config], []
    if isinstance(config, Mapping):
        optimizer = config.get("optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"configure_optimizers() returned a dict whose 'optimizer' is {type(optimizer).__name__}; "
                "it must hold a torch.optim.Optimizer under 'optimizer'"
            )
        sched = config.get("lr_scheduler")
        return [optimizer], ([] if sched is None else [_scheduler_config(sched, steps_schedulers)])
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)) and isinstance(config[1], (list, tuple)):
            optimizers = parse_optimizers(list(config[0]))[0]
            schedulers = [_scheduler_config(s, steps_schedulers) for s in config[1]]
            return optimizers, schedulers
        if config and all(isinstance(o, torch.optim.Optimizer) for o in config):
            return list(config), []
    raise TypeError(
        f"configure_optimizers() returned {type(config).__name__}: return an optimizer, a list of optimizers, "
        "([optimizers], [schedulers]), or {'optimizer': ..., 'lr_scheduler': ...}"
    )


#: The keys of an ``lr_scheduler`` dict torchrig reads.
#: ``reduce_on_plateau`` is read from the scheduler's type; Lightning's key is taken and not needed.
_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "name", "strict", "reduce_on_plateau"}


def _scheduler_config(sched: Any, steps_schedulers: bool) -> SchedulerConfig:
    if isinstance(sched, Mapping):
        unknown = sorted(set(sched) - _SCHEDULER_KEYS)
        if unknown:
            raise ValueError(
                f"lr_scheduler dict has keys torchrig does not know: {unknown}; it takes {sorted(_SCHEDULER_KEYS)}"
            )
        cfg = SchedulerConfig(
            scheduler=sched.get("scheduler"),
            interval=sched.get("interval", "epoch"),
            frequency=int(sched.get("frequency", 1)),
            monitor=sched.get("monitor"),
            name=sched.get("name"),
            strict=bool(sched.get("strict", True)),
        )
    else:
        cfg = SchedulerConfig(scheduler=sched)
    if not steps_schedulers and not isinstance(cfg.scheduler, (LRScheduler, ReduceLROnPlateau)):
        raise TypeError(
            f"lr_scheduler {type(cfg.scheduler).__name__} is not a torch LR scheduler; "
            "give a torch.optim.lr_scheduler object (or {'scheduler': it, 'interval': 'step'}), or define "
            "lr_scheduler_step(self, scheduler, metric) on the module to step it yourself (timm's schedulers)"
        )
    if cfg.interval not in ("step", "epoch"):
        raise ValueError(f"lr_scheduler interval={cfg.interval!r}; use 'step' or 'epoch'")
    if cfg.frequency < 1:
        raise ValueError(f"lr_scheduler frequency={cfg.frequency}; use a positive int")
    if isinstance(cfg.scheduler, ReduceLROnPlateau) and cfg.monitor is None:
        raise ValueError(
            "ReduceLROnPlateau needs the metric it watches: return "
            "{'optimizer': opt, 'lr_scheduler': {'scheduler': plateau, 'monitor': 'val_loss'}}"
        )
    return cfg
