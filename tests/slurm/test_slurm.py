"""Issue 31, section 1: torchrig under a real SLURM (a one-node cluster on localhost, see
``slurm_cluster.py``), driven by ``srun``/``sbatch``/``scancel``/``scontrol`` and real signals.

* a 2-task ``srun`` runs a ``Trainer.fit`` on 2 gloo processes and matches ``torchrig run --devices 2``;
* ``scancel --signal=USR1`` preempts a batch job: ``last`` is committed, ``scontrol requeue`` (run by
  rank 0) really requeues the job, SLURM restarts it with ``SLURM_RESTART_COUNT=1``, it resumes
  by itself and ends with the weights of an uninterrupted run;
* so does ``sbatch --time=1 --signal=USR1@30``, with nothing but SLURM's time-limit warning;
* ``scancel`` (SIGTERM, SIGKILL after ``KillWait``) loses at most the steps since the signal:
  ``last`` is at or after the signal's step, and resuming from it ends with the same weights.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import (  # noqa: F401 (the `slurm` and `fresh_slurm` fixtures)
    KILL_WAIT,
    SlurmCluster,
    fresh_slurm_fixture,
    skip_reason,
    slurm_fixture,
)

from conftest import python_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import SCRIPTS, same_weights, torchrig_run_fit

pytestmark = [pytest.mark.distributed, pytest.mark.slurm]

SCRIPT = str(SCRIPTS / "preempt_fit.py")
#: Slow steps, so that a signal sent after step 3 arrives long before the end (5 epochs, 30 steps).
SLOW = ["--epochs", "5", "--step-sleep", "0.05"]
LAST_STEP = 30


def _env() -> dict[str, str]:
    env = python_env()
    env["TORCHRIG_SIGNAL_CHECK_INTERVAL"] = "0"  # the ranks agree at every step: an exact stop step
    return env


def _explain(what: str, proc: subprocess.CompletedProcess[str] | str, cluster: SlurmCluster) -> str:
    text = proc if isinstance(proc, str) else f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return f"{what}:\n{text}\n{cluster.logs()}"


def test_without_slurm_the_tests_skip_with_one_line_saying_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert skip_reason() == (
        "SLURM is not installed (munged, slurmctld, slurmd, sbatch, srun, scontrol, scancel, squeue missing): "
        "apt-get install slurm-wlm munge (what .ci/run does)"
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The final weights of ``torchrig run --devices 2`` (torchrun), never interrupted."""
    return torchrig_run_fit(tmp_path_factory.mktemp("reference"), *SLOW)


@pytest.mark.timeout(300)
def test_srun_two_tasks_fit_matches_torchrig_run(slurm: SlurmCluster, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "srun.pt"
    done = slurm.run(
        "srun", "--ntasks=2", "--kill-on-bad-exit=1", sys.executable, SCRIPT, str(tmp_path / "root"), str(out), *SLOW,
        env=_env(), timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, _explain("srun", done, slurm)
    # torchrig took its two ranks from SLURM's variables (not from a launcher of its own)
    for rank in (0, 1):
        assert f"rank {rank} of 2 launched by slurm" in done.stdout, _explain("srun", done, slurm)
        assert f"rank {rank} done at step {LAST_STEP}" in done.stdout
    same_weights(reference, out)


def _resumed_at(step: int, text: str) -> bool:
    """Whether ``text`` says the fit resumed from the checkpoint of ``step`` (mid-epoch, or at an
    epoch's end: then it continues with the next epoch)."""
    where = r"(in epoch \d+(/\d+)? after \d+ batches|with epoch \d+(/\d+)?)"  # epochs counted from 0, /last
    return re.search(rf"-> epoch=\d+-step={step}: continues {where}, step {step}\n", text) is not None


def _batch_script(root: Path, out: Path, *extra: str) -> str:
    task = " ".join([sys.executable, SCRIPT, str(root), str(out), *SLOW, *extra])
    return f"srun --kill-on-bad-exit=1 {task}"


def _wait_for(path: Path, slurm: SlurmCluster, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                _explain(f"no {path.name} after {timeout} s", log.read_text() if log.exists() else "", slurm)
            )
        time.sleep(0.05)


def _requeue_job(slurm: SlurmCluster, tmp_path: Path, *sbatch: str, extra: tuple[str, ...] = ()) -> tuple[int, Path]:
    """An ``sbatch --ntasks=2 --requeue`` job running ``preempt_fit.py``; its id, and its log."""
    root, out, log = tmp_path / "root", tmp_path / "requeued.pt", tmp_path / "job.log"
    job = slurm.sbatch(
        "--ntasks=2",
        "--requeue",
        "--open-mode=append",
        f"--output={log}",
        f"--chdir={tmp_path}",
        *sbatch,
        f"--wrap={_batch_script(root, out, *extra)}",
        env=_env(),
    )
    return job, log


def _check_requeued_once_and_resumed(
    slurm: SlurmCluster, job: int, log: Path, reference: Path, timeout: float, update: tuple[str, ...] = ()
) -> None:
    """Wait for the job to end (``update``: ``scontrol update`` fields for its requeued run), and
    check that its first run stopped both ranks at one step and saved it, rank 0 requeued the job,
    and SLURM's restart (``SLURM_RESTART_COUNT=1``, set by SLURM) resumed from that step by itself
    and ended with ``reference``'s weights."""
    info = slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=timeout, update=update)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", _explain(f"job {job}: {info}", text, slurm)
    assert info["Restarts"] == "1", _explain(f"job {job}: {info}", text, slurm)  # SLURM's own count
    # The first run: both ranks stopped at one step, saved it, and rank 0 requeued the job.
    first, second = text.split("torchrig: restart 1 of this job: resuming from", 1)
    assert "rank 0: SIGUSR1: stopping at the next optimizer step to save it" in first, text
    assert "; requeued the job" in first and "done at step" not in first, text
    # torchrig's line, printed once every rank's save was committed and the job requeued; the ranks'
    # own "saved step" lines come after the requeue, so SLURM may end a rank before it prints one.
    summary = re.search(r"torchrig: SIGUSR1: stopped the run; saved step (\d+) as .*; requeued the job", first)
    assert summary is not None, first
    step = int(summary.group(1))
    saved = [line for line in first.splitlines() if " saved step " in line and line.startswith("rank ")]
    assert {int(line.split(" saved step ")[1].split()[0]) for line in saved} <= {step}, saved
    assert 3 <= step < LAST_STEP, step
    # The second run (SLURM_RESTART_COUNT=1, set by SLURM) resumed from that step by itself.
    assert _resumed_at(step, second), second
    assert f"rank 0 done at step {LAST_STEP}" in second, second
    same_weights(reference, log.parent / "requeued.pt")


@pytest.mark.timeout(300)
def test_usr1_requeues_the_job_which_resumes_by_itself_with_an_uninterrupted_runs_weights(
    slurm: SlurmCluster, reference: Path, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    job, log = _requeue_job(slurm, tmp_path, extra=("--ready", str(ready)))
    _wait_for(ready, slurm, log)  # rank 0 is past step 3
    slurm.run("scancel", "--signal=USR1", str(job))  # what --signal=USR1@N does, now
    _check_requeued_once_and_resumed(slurm, job, log, reference, timeout=180)


#: ``--time=1 --signal=USR1@WARN``: slurmctld sends the warning at its first time-limit check
#: (every ``TIME_LIMIT_PERIOD`` s) at most ``WARN + TIME_LIMIT_PERIOD`` s before the limit; with
#: WARN = 30 and a one-minute limit (SLURM's shortest), the first check after the job starts.
WARN = 30
#: Seconds the job gets at the least before that check (it needs ~5 s to reach its first step,
#: 15 on a machine with a load of 10).
STARTUP = 20


@pytest.mark.timeout(120)
def test_time_limit_warning_requeues_the_job_which_resumes_by_itself_with_an_uninterrupted_runs_weights(
    fresh_slurm: SlurmCluster, reference: Path, tmp_path: Path
) -> None:
    """``sbatch --signal=USR1@N`` for real: nothing but SLURM's own timer signals the job. On a
    cluster of its own the test knows when slurmctld checks time limits; the first run is slow
    (``--first-run-sleep``) so that the warning finds it training. The requeued run gets a
    5-minute limit (``scontrol update`` as the test releases it), as a real job's next allocation
    is long: with one minute its own warning would come within 30 s of its start, while it may
    still be ending on a loaded machine (``TimeLimit`` is all that changes)."""
    slurm = fresh_slurm
    now = time.monotonic()
    check = slurm.next_time_limit_check(now)
    if check - now < STARTUP:  # too close: submit after it, a whole period before the next
        time.sleep(check - now + 2)
    job, log = _requeue_job(slurm, tmp_path, "--time=1", f"--signal=USR1@{WARN}", extra=("--first-run-sleep", "1.5"))
    _check_requeued_once_and_resumed(slurm, job, log, reference, timeout=120, update=("TimeLimit=5",))


@pytest.mark.timeout(300)
def test_scancel_loses_at_most_the_steps_since_the_signal(slurm: SlurmCluster, reference: Path, tmp_path: Path) -> None:
    root, out, log, ready = tmp_path / "root", tmp_path / "cancelled.pt", tmp_path / "job.log", tmp_path / "ready"
    job = slurm.sbatch(
        "--ntasks=2",
        f"--output={log}",
        f"--chdir={tmp_path}",
        f"--wrap={_batch_script(root, out, '--ready', str(ready))}",
        env=_env(),
    )
    _wait_for(ready, slurm, log)
    cancelled_at = time.monotonic()
    slurm.run("scancel", str(job))  # SIGTERM to every task, SIGKILL KillWait seconds later
    info = slurm.wait_job(job, ("CANCELLED", "COMPLETED", "FAILED"), timeout=60, release=False)
    took = time.monotonic() - cancelled_at
    text = log.read_text()
    assert info["JobState"] == "CANCELLED", _explain(f"job {job}: {info}", text, slurm)
    saved = [line for line in text.splitlines() if " saved step " in line and line.startswith("rank ")]
    assert len(saved) == 2, _explain("both ranks saved", text, slurm)
    step = int(saved[0].split(" saved step ")[1].split()[0])
    # The signal came after step 3: everything up to it is in `last`, nothing after the stop is.
    assert 3 <= step < LAST_STEP, step
    assert took < KILL_WAIT + 30, took
    # Resuming from `last` (the next allocation) ends where an uninterrupted run ends.
    resumed = slurm.run(
        "srun",
        "--ntasks=2",
        sys.executable,
        SCRIPT,
        str(root),
        str(out),
        *SLOW,
        "--resume",
        env=_env(),
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, _explain("resume", resumed, slurm)
    assert _resumed_at(step, resumed.stdout), resumed.stdout
    assert f"rank 0 done at step {LAST_STEP}" in resumed.stdout, resumed.stdout
    same_weights(reference, out)
