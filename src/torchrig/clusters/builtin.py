"""The launchers torchrig knows: torchrun, MPI, SLURM, LSF and Kubeflow PyTorchJob.

Each reads only the variables its launcher sets; what each needs is in its docstring and in
docs/distributed.md ("Launchers").
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import zlib

from torchrig.clusters.base import ClusterEnvironment, Environ, env_int, first_set

#: Every task of a job derives the same rendezvous port from the job's id, so no task has to
#: tell the others: ``PORT_BASE + id % PORT_SPAN``.
PORT_BASE, PORT_SPAN = 15000, 20000


def job_port(job: str | int) -> int:
    """The port every task of job ``job`` uses when ``MASTER_PORT`` is not set."""
    number = int(job) if isinstance(job, int) or str(job).isdigit() else zlib.crc32(str(job).encode())
    return PORT_BASE + number % PORT_SPAN


class TorchrunEnvironment(ClusterEnvironment):
    """torchrun (``torch.distributed.run``, also what ``torchrig run`` uses): ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``GROUP_RANK``."""

    restart_count_var = "TORCHELASTIC_RESTART_COUNT"
    VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls, environ: Environ) -> ClusterEnvironment | None:
        if not all(k in environ for k in cls.VARS):
            return None
        local_world = environ.get("LOCAL_WORLD_SIZE", "")
        return cls(
            kind="torchrun",
            global_rank=env_int(environ, "RANK"),
            local_rank=env_int(environ, "LOCAL_RANK"),
            node_rank=env_int(environ, "GROUP_RANK", env_int(environ, "NODE_RANK")),
            world_size=env_int(environ, "WORLD_SIZE", 1),
            local_world_size=int(local_world) if local_world.isdigit() else None,
            master_addr=environ["MASTER_ADDR"],
            master_port=env_int(environ, "MASTER_PORT"),
            reason=f"{', '.join(cls.VARS)} are set (torchrun, torchrig run)",
        )


class MPIEnvironment(ClusterEnvironment):
    """``mpirun``/``mpiexec``: Open MPI's ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``,
    MPICH/Intel MPI's ``PMI_RANK``/``PMI_SIZE`` (``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``), or
    ``PMIX_RANK`` with one of those sizes. The rendezvous address is ``MASTER_ADDR``/
    ``MASTER_PORT`` (``mpirun -x``); on one machine, 127.0.0.1 and a port derived from the MPI job."""

    RANKS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    LOCAL_RANKS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID")
    LOCAL_SIZES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE")
    #: Variables that name one MPI job, the same in every one of its processes.
    JOB_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri", "PMI_FD", "PMI_PORT")

    @classmethod
    def detect(cls, environ: Environ) -> ClusterEnvironment | None:
        rank_var, size_var = first_set(environ, *cls.RANKS), first_set(environ, *cls.SIZES)
        if rank_var is None or size_var is None:
            return None
        world = env_int(environ, size_var, 1)
        local_var, local_size_var = first_set(environ, *cls.LOCAL_RANKS), first_set(environ, *cls.LOCAL_SIZES)
        rank = env_int(environ, rank_var)
        local_size = env_int(environ, local_size_var, world) if local_size_var else world
        addr, port = environ.get("MASTER_ADDR"), env_int(environ, "MASTER_PORT")
        if addr is None and local_size == world:  # one machine
            addr = "127.0.0.1"
        if not port:
            job = next((environ[v] for v in cls.JOB_VARS if environ.get(v)), None)
            port = job_port(job) if job is not None else 0
        return cls(
            kind="mpi",
            global_rank=rank,
            local_rank=env_int(environ, local_var) if local_var else rank,
            node_rank=rank // max(local_size, 1),
            world_size=world,
            local_world_size=local_size,
            master_addr=addr,
            master_port=port or None,
            reason=f"{rank_var} and {size_var} are set (mpirun)",
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


class SlurmEnvironment(ClusterEnvironment):
    """SLURM, ``srun`` with one task per device: ``SLURM_PROCID``, ``SLURM_LOCALID``,
    ``SLURM_NODEID``, ``SLURM_NTASKS``; the address from ``MASTER_ADDR`` or the first host of
    ``SLURM_NODELIST``, the port from ``MASTER_PORT`` or the job id. A job of one task (or an
    interactive ``salloc`` shell) is no multi-task step: torchrig starts the processes, and the job
    is still requeued on its signal (``scontrol requeue``)."""

    restart_count_var = "SLURM_RESTART_COUNT"

    @classmethod
    def detect(cls, environ: Environ) -> ClusterEnvironment | None:
        if "SLURM_NTASKS" not in environ or "SLURM_PROCID" not in environ:
            return None
        # An interactive allocation (``salloc`` then ``python``) is not a multi-task job step.
        if environ.get("SLURM_JOB_NAME") in ("bash", "interactive") or env_int(environ, "SLURM_NTASKS", 1) < 2:
            return None
        return cls(
            kind="slurm",
            global_rank=env_int(environ, "SLURM_PROCID"),
            local_rank=env_int(environ, "SLURM_LOCALID"),
            node_rank=env_int(environ, "SLURM_NODEID"),
            world_size=env_int(environ, "SLURM_NTASKS", 1),
            local_world_size=env_int(environ, "SLURM_NTASKS_PER_NODE", 0) or None,
            master_addr=environ.get("MASTER_ADDR") or first_slurm_host(environ.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=env_int(environ, "MASTER_PORT", 0) or job_port(env_int(environ, "SLURM_JOB_ID")),
            reason=f"SLURM_PROCID and SLURM_NTASKS={environ['SLURM_NTASKS']} are set (srun)",
        )

    @classmethod
    def job_id(cls, environ: Environ) -> str | None:
        """The id ``scontrol requeue`` takes for this job (``ARRAYJOB_TASK`` for an array task)."""
        if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
            return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
        return environ.get("SLURM_JOB_ID")

    @classmethod
    def requeue(cls, environ: Environ) -> str | None:
        """Run ``scontrol requeue <job>``; None when it worked, else why not."""
        job = cls.job_id(environ)
        if job is None:
            return "SLURM_JOB_ID is not set"
        return run_command(["scontrol", "requeue", job])


def run_command(cmd: list[str], timeout: float = 60) -> str | None:
    """Run a scheduler command; None when it exited 0, else why not (to be printed)."""
    exe = shutil.which(cmd[0])
    if exe is None:
        return f"{cmd[0]} is not on PATH"
    shown = " ".join(cmd)
    try:
        done = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as err:
        return f"`{shown}` failed: {err}"
    if done.returncode != 0:
        return f"`{shown}` exited with {done.returncode}: {(done.stderr or done.stdout).strip()}"
    return None


class LSFEnvironment(ClusterEnvironment):
    """IBM LSF with ``jsrun``: ``JSM_NAMESPACE_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`` and ``LSB_JOBID``;
    the hosts from ``LSB_MCPU_HOSTS`` (the first is the launch node when there are several), the
    address from ``MASTER_ADDR`` or the first compute host, the port from ``MASTER_PORT`` or the
    job id. Requeued with ``brequeue``."""

    @classmethod
    def detect(cls, environ: Environ) -> ClusterEnvironment | None:
        if "LSB_JOBID" not in environ or "JSM_NAMESPACE_RANK" not in environ or "JSM_NAMESPACE_SIZE" not in environ:
            return None
        hosts = cls.compute_hosts(environ)
        here = socket.gethostname()
        return cls(
            kind="lsf",
            global_rank=env_int(environ, "JSM_NAMESPACE_RANK"),
            local_rank=env_int(environ, "JSM_NAMESPACE_LOCAL_RANK"),
            node_rank=hosts.index(here) if here in hosts else 0,
            world_size=env_int(environ, "JSM_NAMESPACE_SIZE", 1),
            local_world_size=env_int(environ, "JSM_NAMESPACE_LOCAL_SIZE", 0) or None,
            master_addr=environ.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
            master_port=env_int(environ, "MASTER_PORT", 0) or job_port(environ["LSB_JOBID"]),
            reason="LSB_JOBID, JSM_NAMESPACE_RANK and JSM_NAMESPACE_SIZE are set (jsrun)",
        )

    @staticmethod
    def compute_hosts(environ: Environ) -> list[str]:
        """The job's hosts from ``LSB_MCPU_HOSTS`` (``"launch 1 hostA 4 hostB 4"``), without the launch node."""
        hosts = environ.get("LSB_MCPU_HOSTS", "").split()[::2]
        return hosts[1:] if len(hosts) > 1 else hosts

    @classmethod
    def job_id(cls, environ: Environ) -> str | None:
        return environ.get("LSB_JOBID")

    @classmethod
    def requeue(cls, environ: Environ) -> str | None:
        """Run ``brequeue <job>``; None when it worked, else why not."""
        job = cls.job_id(environ)
        return "LSB_JOBID is not set" if job is None else run_command(["brequeue", job])


class KubeflowEnvironment(ClusterEnvironment):
    """A Kubeflow PyTorchJob, one process per pod: ``RANK`` (the pod's), ``WORLD_SIZE`` (pods),
    ``MASTER_ADDR``/``MASTER_PORT`` and no ``LOCAL_RANK`` (torchrun sets that), in a Kubernetes
    pod (``KUBERNETES_SERVICE_HOST``). Each pod is one node."""

    VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "KUBERNETES_SERVICE_HOST")

    @classmethod
    def detect(cls, environ: Environ) -> ClusterEnvironment | None:
        if not all(k in environ for k in cls.VARS) or "LOCAL_RANK" in environ:
            return None
        rank = env_int(environ, "RANK")
        return cls(
            kind="kubeflow",
            global_rank=rank,
            local_rank=0,
            node_rank=rank,
            world_size=env_int(environ, "WORLD_SIZE", 1),
            local_world_size=1,
            master_addr=environ["MASTER_ADDR"],
            master_port=env_int(environ, "MASTER_PORT"),
            reason="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set in a Kubernetes pod, LOCAL_RANK not (PyTorchJob)",
        )


BUILTINS: dict[str, tuple[type[ClusterEnvironment], str]] = {
    "torchrun": (TorchrunEnvironment, "torchrun / torchrig run (RANK, LOCAL_RANK, WORLD_SIZE)"),
    "mpi": (MPIEnvironment, "mpirun: Open MPI (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_*), PMIx"),
    "slurm": (SlurmEnvironment, "SLURM srun tasks (SLURM_PROCID, SLURM_NTASKS); requeues with scontrol"),
    "lsf": (LSFEnvironment, "IBM LSF jsrun (LSB_JOBID, JSM_NAMESPACE_*); requeues with brequeue"),
    "kubeflow": (KubeflowEnvironment, "Kubeflow PyTorchJob, one process per pod (RANK, WORLD_SIZE, MASTER_ADDR)"),
}
