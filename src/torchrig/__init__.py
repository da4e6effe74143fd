"""torchrig: one PyTorch training program, unchanged, on any hardware and any number of processes."""

from __future__ import annotations

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
from torchrig.trainer.timer import Timer

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``torchrig.cli`` (``torchrig.cli.CLI(MyModule, MyData)``) and ``torchrig.tune``
    (``torchrig.tune.lr_find(...)``) without importing them at ``import torchrig``."""
    if name in ("cli", "tune"):
        import importlib

        return importlib.import_module(f"torchrig.{name}")
    raise AttributeError(f"module 'torchrig' has no attribute {name!r}")


__all__ = [
    "ACCELERATOR_REGISTRY",
    "CLUSTER_ENVIRONMENTS",
    "EMA",
    "PRECISIONS",
    "STRATEGY_REGISTRY",
    "Accelerator",
    "BasePredictionWriter",
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
    "LearningRateMonitor",
    "MLflowLogger",
    "ModelCheckpoint",
    "ModelParallelStrategy",
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
    "Strategy",
    "TQDMProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "Timer",
    "TorchDeviceAccelerator",
    "Trainer",
    "TrainingModule",
    "WandbLogger",
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
