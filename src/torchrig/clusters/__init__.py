"""Cluster environments: the launchers torchrig detects, and the registry users add theirs to."""

from __future__ import annotations

from torchrig.clusters.base import ClusterEnvironment
from torchrig.clusters.builtin import (
    BUILTINS,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    first_slurm_host,
)
from torchrig.clusters.registry import CLUSTER_ENVIRONMENTS, ClusterEnvironmentRegistry, detect_environment

for _name, (_cls, _description) in BUILTINS.items():
    CLUSTER_ENVIRONMENTS.register_builtin(_name, _cls, description=_description)

__all__ = [
    "CLUSTER_ENVIRONMENTS",
    "ClusterEnvironment",
    "ClusterEnvironmentRegistry",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "SlurmEnvironment",
    "TorchrunEnvironment",
    "detect_environment",
    "first_slurm_host",
]
