"""``CLUSTER_ENVIRONMENTS``: every launcher torchrig can detect, tried in order."""

from __future__ import annotations

import os
import sys
from typing import cast

from torchrig.clusters.base import ClusterEnvironment, Environ
from torchrig.registry import Registry


class ClusterEnvironmentRegistry(Registry[ClusterEnvironment]):
    """The cluster-environment registry, plus :meth:`detect` and :meth:`requeue`.

    Detection tries a user's (or a plugin's) classes first, in the order they were registered,
    then the built-ins: torchrun, MPI, SLURM, LSF, Kubeflow (the most specific variables first:
    ``torchrun`` inside a SLURM allocation is torchrun, ``mpirun`` inside one is MPI).
    """

    def classes(self) -> list[tuple[str, type[ClusterEnvironment]]]:
        """``(name, class)`` in the order detection tries them."""
        self._load_entry_points()
        entries = list(self._entries.values())
        ordered = [e for e in entries if not e.builtin] + [e for e in entries if e.builtin]
        return [(e.name, cast(type[ClusterEnvironment], e.factory)) for e in ordered]

    def detect(self, environ: Environ | None = None) -> ClusterEnvironment:
        """The launcher around this process (``kind="none"`` when no class recognises it)."""
        environ = os.environ if environ is None else environ
        for _, cls in self.classes():
            found = cls.detect(environ)
            if found is not None:
                return found
        job = self.job(environ)
        if job is not None:
            why = f"{job[0]} job {job[2]} runs this as one task: torchrig starts the processes itself"
        else:
            why = f"no launcher's variables are set (tried {', '.join(name for name, _ in self.classes())})"
        return ClusterEnvironment(kind="none", reason=why)

    def job(self, environ: Environ | None = None) -> tuple[str, type[ClusterEnvironment], str] | None:
        """``(name, class, job id)`` of the scheduler job this process runs in, if any."""
        environ = os.environ if environ is None else environ
        for name, cls in self.classes():
            job = cls.job_id(environ)
            if job is not None:
                return name, cls, job
        return None

    def requeue(self, environ: Environ | None = None) -> str | None:
        """Requeue the scheduler job this process runs in; ``None`` when that worked, else why not."""
        environ = os.environ if environ is None else environ
        found = self.job(environ)
        if found is None:
            return "this process runs in no scheduler job (SLURM_JOB_ID is not set)"
        return found[1].requeue(environ)

    def restart_count(self, environ: Environ | None = None) -> int:
        """How many times a launcher has restarted this job (the largest count any launcher sets)."""
        environ = os.environ if environ is None else environ
        counts = [0]
        for _, cls in self.classes():
            var = cls.restart_count_var
            if var and var in environ:
                try:
                    counts.append(int(environ[var]))
                except ValueError:
                    print(f"torchrig: ignoring {var}={environ[var]!r} (not a number)", file=sys.stderr)
        return max(counts)


#: Launchers by short name. Third-party packages register through the entry-point group
#: ``torchrig.cluster_environments`` (a ClusterEnvironment subclass with
#: ``register_cluster_environments``, or a function that takes the registry).
CLUSTER_ENVIRONMENTS = ClusterEnvironmentRegistry(
    kind="cluster environment",
    entry_point_group="torchrig.cluster_environments",
    hook="register_cluster_environments",
)


def detect_environment(environ: Environ | None = None) -> ClusterEnvironment:
    """The launcher around this process: the first registered class that recognises it.

    Example:
        >>> detect_environment({}).kind
        'none'
        >>> detect_environment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).global_rank
        1
    """
    return CLUSTER_ENVIRONMENTS.detect(environ)


__all__ = ["CLUSTER_ENVIRONMENTS", "ClusterEnvironmentRegistry", "detect_environment"]
