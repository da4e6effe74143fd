"""The Trainer layer: loops, hooks, callbacks and loggers over a :class:`~torchrig.Rig`."""

from __future__ import annotations

from torchrig.trainer.callbacks import Callback, EventSchedule
from torchrig.trainer.checkpointing import ModelCheckpoint
from torchrig.trainer.datamodule import DataModule
from torchrig.trainer.early_stopping import EarlyStopping
from torchrig.trainer.logger_base import Logger
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.monitors import DeviceStatsMonitor, LearningRateMonitor
from torchrig.trainer.throughput import ThroughputMonitor
from torchrig.trainer.trainer import Trainer

__all__ = [
    "Callback",
    "DataModule",
    "DeviceStatsMonitor",
    "EarlyStopping",
    "EventSchedule",
    "LearningRateMonitor",
    "Logger",
    "ModelCheckpoint",
    "ThroughputMonitor",
    "Trainer",
    "TrainingModule",
]
