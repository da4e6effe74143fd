"""``ClusterEnvironment``: who started this process, where it sits in the job, and how to requeue.

A launcher (torchrun, SLURM's ``srun``, ``mpirun``, a Kubeflow PyTorchJob, LSF's ``jsrun``) says
where a process sits through environment variables. Each launcher is a subclass with a
:meth:`ClusterEnvironment.detect` classmethod that reads them; detection returns an instance (a
frozen record of the process's place) or ``None``. The subclasses live in
:data:`torchrig.CLUSTER_ENVIRONMENTS` (:mod:`torchrig.clusters.registry`), tried in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

Environ = Mapping[str, str]


def env_int(environ: Environ, name: str, default: int = 0) -> int:
    """``environ[name]`` as an int; ``default`` when unset or not a number."""
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def first_set(environ: Environ, *names: str) -> str | None:
    """The first of ``names`` set in ``environ`` (None: none is)."""
    return next((n for n in names if n in environ), None)


@dataclass(frozen=True)
class ClusterEnvironment:
    """Where this process sits in the job, as a launcher placed it.

    Subclass it for a launcher torchrig does not know: implement :meth:`detect` (and
    :meth:`requeue` when the scheduler can requeue a job), then register the class, as an
    accelerator is registered: a ``register_cluster_environments`` classmethod (called when the
    class is defined), ``torchrig.CLUSTER_ENVIRONMENTS.register(name, cls)``, or the
    ``torchrig.cluster_environments`` entry point.

    Attributes:
        kind: the launcher's registry name (``"torchrun"``, ``"slurm"``, ``"mpi"``, ``"kubeflow"``,
            ``"lsf"``, a user's own), ``"torchrig"`` (rank 0 of torchrig's own launcher) or
            ``"none"``.
        global_rank, local_rank, node_rank, world_size: this process's place.
        local_world_size: processes on this node (``None`` when the launcher does not say).
        master_addr, master_port: the rendezvous address (``None`` when not known).
        reason: why this environment was detected (``torchrig env`` prints it).

    Example:
        >>> import torchrig
        >>> class Sim(torchrig.ClusterEnvironment):
        ...     @classmethod
        ...     def detect(cls, environ):
        ...         if "SIM_RANK" not in environ:
        ...             return None
        ...         return cls(kind="sim", global_rank=int(environ["SIM_RANK"]), world_size=2,
        ...                    master_addr="127.0.0.1", master_port=29555, reason="SIM_RANK is set")
        ...     @classmethod
        ...     def register_cluster_environments(cls, registry):
        ...         registry.register("sim", cls, description="doc example", override=True)
        >>> torchrig.detect_environment({"SIM_RANK": "1"}).global_rank
        1
        >>> torchrig.CLUSTER_ENVIRONMENTS.remove("sim")
    """

    kind: str = "none"
    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    reason: str = ""

    #: The environment variables a requeued job reads to know it was restarted (0: first run).
    restart_count_var: ClassVar[str | None] = None

    @classmethod
    def detect(cls, environ: Environ) -> ClusterEnvironment | None:
        """This process's place if this launcher started it, else ``None``."""
        return None

    @classmethod
    def job_id(cls, environ: Environ) -> str | None:
        """The id of the scheduler job this process runs in (``None``: not in one of this
        scheduler's jobs). A job of one task, where torchrig starts the processes itself, has one too."""
        return None

    @classmethod
    def requeue(cls, environ: Environ) -> str | None:
        """Put the job back in the scheduler's queue; ``None`` when that worked, else why not."""
        return f"{cls.__name__} cannot requeue a job"

    @property
    def launched(self) -> bool:
        """True when a launcher placed this process in a job; False: torchrig starts the processes."""
        return self.kind != "none"

    @classmethod
    def register_cluster_environments(cls, registry: Any) -> None:
        """Register this class under its short name; override it to make the class detectable."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "register_cluster_environments" in cls.__dict__:
            from torchrig.clusters.registry import CLUSTER_ENVIRONMENTS

            cls.register_cluster_environments(CLUSTER_ENVIRONMENTS)
