"""torchrig: one PyTorch training program, unchanged, on any hardware and any number of processes."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers; at run time each loads on first use
    from torchrig.accelerators import (
        ACCELERATOR_REGISTRY,
        Accelerator,
        CPUAccelerator,
        TorchDeviceAccelerator,
        XLAAccelerator,
    )
    from torchrig.checkpoint import CheckpointError
    from torchrig.clusters import CLUSTER_ENVIRONMENTS, ClusterEnvironment, detect_environment
    from torchrig.devices import current_device_index, device_index, set_device_index
    from torchrig.diagnostics import DeviceMismatchError
    from torchrig.fp8 import FP8Mixed
    from torchrig.nested import move_to_device
    from torchrig.planner import plan
    from torchrig.precision import PRECISIONS, Precision
    from torchrig.preemption import Preempted
    from torchrig.resolve import Plan, resolve
    from torchrig.rig import Rig, seed_everything
    from torchrig.strategies import (
        STRATEGY_REGISTRY,
        DDPStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
        Strategy,
    )
    from torchrig.trainer import (
        Callback,
        DataModule,
        DeviceStatsMonitor,
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ThroughputMonitor,
        Trainer,
        TrainingModule,
    )
    from torchrig.trainer.accumulation import GradientAccumulationScheduler
    from torchrig.trainer.ema import EMA
    from torchrig.trainer.finetuning import BackboneFinetuning, BaseFinetuning
    from torchrig.trainer.lambda_callback import LambdaCallback
    from torchrig.trainer.lightning_names import (
        EMAWeightAveraging,
        ModelSummary,
        OnExceptionCheckpoint,
        RichModelSummary,
        RichProgressBar,
        TQDMProgressBar,
    )
    from torchrig.trainer.loggers import CSVLogger, TensorBoardLogger  # tensorboard itself loads on first use
    from torchrig.trainer.loggers_mlflow import MLflowLogger  # mlflow itself loads when one is made
    from torchrig.trainer.loggers_wandb import WandbLogger  # wandb itself loads when one is made
    from torchrig.trainer.prediction_writer import BasePredictionWriter
    from torchrig.trainer.profiler import Profiler, PyTorchProfiler, SimpleProfiler
    from torchrig.trainer.progress import ProgressBar
    from torchrig.trainer.pruning import ModelPruning
    from torchrig.trainer.spike import SpikeDetection, TrainingSpikeException
    from torchrig.trainer.timer import Timer
    from torchrig.trainer.weight_averaging import StochasticWeightAveraging, WeightAveraging
    from torchrig.tune.callbacks import BatchSizeFinder, LearningRateFinder

__version__ = "0.1.0"

#: Where each public name is defined. ``import torchrig`` imports none of them, nor torch, so
#: ``torchrig --version`` and ``torchrig --help`` answer at once; a name's first use imports its
#: module (``torchrig.Rig`` imports torch and the Rig, as ``from torchrig import Rig`` does).
_EXPORTS: dict[str, str] = {
    "ACCELERATOR_REGISTRY": "torchrig.accelerators",
    "Accelerator": "torchrig.accelerators",
    "CPUAccelerator": "torchrig.accelerators",
    "TorchDeviceAccelerator": "torchrig.accelerators",
    "XLAAccelerator": "torchrig.accelerators",
    "CheckpointError": "torchrig.checkpoint",
    "CLUSTER_ENVIRONMENTS": "torchrig.clusters",
    "ClusterEnvironment": "torchrig.clusters",
    "detect_environment": "torchrig.clusters",
    "current_device_index": "torchrig.devices",
    "device_index": "torchrig.devices",
    "set_device_index": "torchrig.devices",
    "DeviceMismatchError": "torchrig.diagnostics",
    "FP8Mixed": "torchrig.fp8",
    "move_to_device": "torchrig.nested",
    "plan": "torchrig.planner",
    "PRECISIONS": "torchrig.precision",
    "Precision": "torchrig.precision",
    "Preempted": "torchrig.preemption",
    "Plan": "torchrig.resolve",
    "resolve": "torchrig.resolve",
    "Rig": "torchrig.rig",
    "seed_everything": "torchrig.rig",
    "STRATEGY_REGISTRY": "torchrig.strategies",
    "DDPStrategy": "torchrig.strategies",
    "FSDPStrategy": "torchrig.strategies",
    "ModelParallelStrategy": "torchrig.strategies",
    "SingleDeviceStrategy": "torchrig.strategies",
    "Strategy": "torchrig.strategies",
    "Callback": "torchrig.trainer",
    "DataModule": "torchrig.trainer",
    "DeviceStatsMonitor": "torchrig.trainer",
    "EarlyStopping": "torchrig.trainer",
    "LearningRateMonitor": "torchrig.trainer",
    "ModelCheckpoint": "torchrig.trainer",
    "ThroughputMonitor": "torchrig.trainer",
    "Trainer": "torchrig.trainer",
    "TrainingModule": "torchrig.trainer",
    "EMA": "torchrig.trainer.ema",
    "BackboneFinetuning": "torchrig.trainer.finetuning",
    "BaseFinetuning": "torchrig.trainer.finetuning",
    "GradientAccumulationScheduler": "torchrig.trainer.accumulation",
    "LambdaCallback": "torchrig.trainer.lambda_callback",
    "EMAWeightAveraging": "torchrig.trainer.lightning_names",
    "ModelSummary": "torchrig.trainer.lightning_names",
    "OnExceptionCheckpoint": "torchrig.trainer.lightning_names",
    "RichModelSummary": "torchrig.trainer.lightning_names",
    "RichProgressBar": "torchrig.trainer.lightning_names",
    "TQDMProgressBar": "torchrig.trainer.lightning_names",
    "BasePredictionWriter": "torchrig.trainer.prediction_writer",
    "Timer": "torchrig.trainer.timer",
    "StochasticWeightAveraging": "torchrig.trainer.weight_averaging",
    "WeightAveraging": "torchrig.trainer.weight_averaging",
    "BatchSizeFinder": "torchrig.tune.callbacks",
    "LearningRateFinder": "torchrig.tune.callbacks",
    "CSVLogger": "torchrig.trainer.loggers",
    "TensorBoardLogger": "torchrig.trainer.loggers",
    "MLflowLogger": "torchrig.trainer.loggers_mlflow",
    "WandbLogger": "torchrig.trainer.loggers_wandb",
    "Profiler": "torchrig.trainer.profiler",
    "PyTorchProfiler": "torchrig.trainer.profiler",
    "SimpleProfiler": "torchrig.trainer.profiler",
    "ProgressBar": "torchrig.trainer.progress",
    "ModelPruning": "torchrig.trainer.pruning",
    "SpikeDetection": "torchrig.trainer.spike",
    "TrainingSpikeException": "torchrig.trainer.spike",
}


def __getattr__(name: str) -> Any:
    """A public name, imported on first use; or a submodule (``torchrig.cli.CLI(MyModule,
    MyData)``, ``torchrig.tune.lr_find(...)``)."""
    where = _EXPORTS.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where), name)
        globals()[name] = value  # once: later uses are plain attribute reads
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'torchrig' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(ModuleType):
    """``torchrig`` itself. Importing a submodule sets it as an attribute of its package, which
    would hide a public name it shares (``torchrig.resolve``, the function, from the module
    ``torchrig.resolve``): the public name is kept, as the eager imports kept it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and _EXPORTS.get(name) == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "ACCELERATOR_REGISTRY",
    "CLUSTER_ENVIRONMENTS",
    "EMA",
    "PRECISIONS",
    "STRATEGY_REGISTRY",
    "Accelerator",
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "BatchSizeFinder",
    "CPUAccelerator",
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "ClusterEnvironment",
    "DDPStrategy",
    "DataModule",
    "DeviceMismatchError",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "FP8Mixed",
    "FSDPStrategy",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LearningRateFinder",
    "LearningRateMonitor",
    "MLflowLogger",
    "ModelCheckpoint",
    "ModelParallelStrategy",
    "ModelPruning",
    "ModelSummary",
    "OnExceptionCheckpoint",
    "Plan",
    "Precision",
    "Preempted",
    "Profiler",
    "ProgressBar",
    "PyTorchProfiler",
    "RichModelSummary",
    "RichProgressBar",
    "Rig",
    "SimpleProfiler",
    "SingleDeviceStrategy",
    "SpikeDetection",
    "StochasticWeightAveraging",
    "Strategy",
    "TQDMProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "Timer",
    "TorchDeviceAccelerator",
    "Trainer",
    "TrainingModule",
    "TrainingSpikeException",
    "WandbLogger",
    "WeightAveraging",
    "XLAAccelerator",
    "__version__",
    "current_device_index",
    "detect_environment",
    "device_index",
    "move_to_device",
    "plan",
    "resolve",
    "seed_everything",
    "set_device_index",
]
