"""Cluster environments: who started this process, and where it sits in the job.

Three cases, detected from the environment variables each launcher sets:

* ``torchrun`` (``torch.distributed.run``, also what ``torchrig run`` uses): ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``. torchrig starts nothing.
* SLURM (``srun`` with one task per device): ``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NODEID``, ``SLURM_NTASKS``. torchrig starts nothing.
* none: a plain ``python script.py``; the strategy may start the other processes itself.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterEnvironment:
    """Where this process sits in the job.

    Attributes:
        kind: ``"torchrun"``, ``"slurm"``, ``"torchrig"`` (rank 0 of :class:`SubprocessLauncher`,
            in :mod:`torchrig.strategies.launch`) or ``"none"``.
        global_rank, local_rank, node_rank, world_size: this process's place.
        local_world_size: processes on this node (``None`` when the launcher does not say).
        master_addr, master_port: the rendezvous address (``None`` when not known yet).
    """

    kind: str
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def launched(self) -> bool:
        """True when a launcher (torchrun, SLURM, or torchrig's own) placed this process in a job."""
        return self.kind != "none"


def _int(name: str, default: int = 0) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _torchrun() -> ClusterEnvironment | None:
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    local_world = env.get("LOCAL_WORLD_SIZE")
    return ClusterEnvironment(
        kind="torchrun",
        global_rank=_int("RANK"),
        local_rank=_int("LOCAL_RANK"),
        node_rank=_int("GROUP_RANK", _int("NODE_RANK")),
        world_size=_int("WORLD_SIZE", 1),
        local_world_size=int(local_world) if local_world and local_world.isdigit() else None,
        master_addr=env["MASTER_ADDR"],
        master_port=_int("MASTER_PORT"),
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list such as ``"node[03-05,9],gpu1"`` -> ``node03``."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return "127.0.0.1"
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _slurm() -> ClusterEnvironment | None:
    env = os.environ
    if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env:
        return None
    # An interactive allocation (``salloc`` then ``python``) is not a multi-task job step.
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive") or _int("SLURM_NTASKS", 1) < 2:
        return None
    job_id = _int("SLURM_JOB_ID", 0)
    return ClusterEnvironment(
        kind="slurm",
        global_rank=_int("SLURM_PROCID"),
        local_rank=_int("SLURM_LOCALID"),
        node_rank=_int("SLURM_NODEID"),
        world_size=_int("SLURM_NTASKS", 1),
        local_world_size=_int("SLURM_NTASKS_PER_NODE", 0) or None,
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1")),
        # Every task derives the same port from the job id, so no task has to tell the others.
        master_port=_int("MASTER_PORT", 0) or 15000 + job_id % 20000,
    )


def detect_environment() -> ClusterEnvironment:
    """The launcher around this process: torchrun first, then SLURM, else none.

    Example:
        >>> detect_environment().kind in ("none", "torchrun", "slurm")
        True
    """
    return _torchrun() or _slurm() or ClusterEnvironment(kind="none")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])
