"""Issue 31, section 2: ``mpirun -n 2`` (Open MPI, Debian's ``openmpi-bin``) runs a 2-process
``Trainer.fit`` whose ranks come from ``OMPI_COMM_WORLD_*`` and whose rendezvous port every rank
derives from the MPI job; its weights equal ``torchrig run --devices 2``'s."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, env, explain, same_weights, torchrig_run_fit

NO_MPIRUN = "mpirun is not installed: apt-get install openmpi-bin (what .ci/run does)"
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(shutil.which("mpirun") is None, reason=NO_MPIRUN)]

EXTRA = ["--epochs", "2"]


@pytest.mark.timeout(240)
def test_mpirun_two_processes_fit_matches_torchrig_run(tmp_path: Path) -> None:
    reference = torchrig_run_fit(tmp_path, *EXTRA)
    out = tmp_path / "mpi.pt"
    # --bind-to none: Open MPI would pin each process to one core; --oversubscribe: a machine with
    # fewer slots than 2 still runs it. Open MPI refuses root unless told (CI runs as root).
    mpi_env = {**env(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = ["mpirun", "-n", "2", "--bind-to", "none", "--oversubscribe", sys.executable, str(SCRIPTS / "preempt_fit.py")]
    cmd += [str(tmp_path / "mpi"), str(out), *EXTRA]
    done = subprocess.run(cmd, env=mpi_env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, explain(done)
    for rank in (0, 1):
        assert f"rank {rank} of 2 launched by mpi" in done.stdout, explain(done)
        assert f"rank {rank} done at step 12" in done.stdout, explain(done)
    same_weights(reference, out)
