"""Strategies: how processes and replicas are laid out."""

from __future__ import annotations

from torchrig.clusters import ClusterEnvironment, detect_environment
from torchrig.strategies.base import Strategy
from torchrig.strategies.ddp import DDPStrategy
from torchrig.strategies.fsdp import FSDPStrategy
from torchrig.strategies.model_parallel import ModelParallelStrategy
from torchrig.strategies.parallel import ParallelStrategy
from torchrig.strategies.registry import STRATEGY_REGISTRY
from torchrig.strategies.single import SingleDeviceStrategy
from torchrig.strategies.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

STRATEGY_REGISTRY.register_builtin("single", SingleDeviceStrategy, description="One process on one device")
STRATEGY_REGISTRY.register_builtin(
    "ddp",
    DDPStrategy,
    description="DistributedDataParallel; processes from torchrun/SLURM, or the script re-run as subprocesses",
)
STRATEGY_REGISTRY.register_builtin(
    "ddp_spawn",
    DDPStrategy,
    description="DistributedDataParallel; rig.launch(fn) starts workers with torch.multiprocessing spawn",
    start_method="spawn",
)
STRATEGY_REGISTRY.register_builtin(
    "ddp_notebook",
    DDPStrategy,
    description="DistributedDataParallel; rig.launch(fn) forks workers (for notebooks)",
    start_method="fork",
)
STRATEGY_REGISTRY.register_builtin(
    "fsdp", FSDPStrategy, description="FSDP2 fully_shard: parameters, gradients and optimizer state sharded"
)
STRATEGY_REGISTRY.register_builtin(
    "model_parallel",
    ModelParallelStrategy,
    description="N-D parallel on a named DeviceMesh: HSDP replicas x FSDP2 shards x tensor parallel",
)

__all__ = [
    "STRATEGY_REGISTRY",
    "ClusterEnvironment",
    "DDPStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "detect_environment",
]
