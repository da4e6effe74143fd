"""Preemption (issue 16, sections 1 and 2): a stop signal to one rank stops every rank at the same
optimizer step with ``last`` saved there, and the run resumed from it ends bitwise equal to one
never stopped; under SLURM the job is requeued after the save, and a restarted job resumes by itself."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, env, explain, run, same_weights

from torchrig.strategies.launch import find_free_port

SCRIPT = str(SCRIPTS / "preempt_fit.py")


def _fit(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run([SCRIPT, str(tmp / name), str(tmp / f"{name}.pt"), "--launcher", *extra], timeout=90)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_to_rank_1_only_stops_both_at_one_step_and_the_resumed_run_is_bitwise_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", "0")  # the ranks check at every step: an exact step
    started = time.monotonic()
    stopped = _fit(tmp_path, "stopped", "--signal", "SIGTERM", "--signal-rank", "1", "--signal-at", "8")
    took = time.monotonic() - started
    assert stopped.returncode == 143, explain(stopped)  # 128 + SIGTERM, from the launching process
    assert "rank 1: SIGTERM: stopping at the next optimizer step to save it" in stopped.stderr, explain(stopped)
    # Rank 1 got the signal after step 8; every rank learns it one step later and saves step 9.
    last = (tmp_path / "stopped" / "checkpoints" / "last").resolve()
    assert last.name == "epoch=1-step=9", explain(stopped)
    for rank in (0, 1):
        assert f"rank {rank} saved step 9 at {last}" in stopped.stdout, explain(stopped)
    assert f"torchrig: SIGTERM: stopped the run; saved step 9 as {last}" in stopped.stdout
    assert "done at step" not in stopped.stdout
    assert took < 60, took
    resumed = _fit(tmp_path, "stopped", "--resume")
    assert resumed.returncode == 0, explain(resumed)
    assert "resumed from" in resumed.stdout and "step 9" in resumed.stdout, explain(resumed)
    clean = _fit(tmp_path, "clean")
    assert clean.returncode == 0, explain(clean)
    assert "rank 0 done at step 18" in clean.stdout and "rank 0 done at step 18" in resumed.stdout
    same_weights(tmp_path / "clean.pt", tmp_path / "stopped.pt")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_signal_after_the_last_step_still_stops_both_ranks_with_last_saved_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/distributed.md: the ranks check once more, blocking, when the fit ends, "so a signal
    during the last step still stops the run with ``last`` saved". The checks during the fit are
    far apart here (an interval of 1000 s: polls 1, 2, 4, 8, 16, ...), so only that last check
    can see a signal rank 1 gets after step 18, the last."""
    monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", "1000")
    stopped = _fit(tmp_path, "stopped", "--signal", "SIGTERM", "--signal-rank", "1", "--signal-at", "18")
    assert stopped.returncode == 143, explain(stopped)
    last = (tmp_path / "stopped" / "checkpoints" / "last").resolve()
    assert last.name == "epoch=2-step=18", explain(stopped)
    for rank in (0, 1):
        assert f"rank {rank} saved step 18 at {last}" in stopped.stdout, explain(stopped)
    assert f"torchrig: SIGTERM: stopped the run; saved step 18 as {last}" in stopped.stdout, explain(stopped)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_that_is_late_when_the_signal_comes_still_stops_at_the_same_step(tmp_path: Path) -> None:
    # The default check interval (1 s). Rank 0 sleeps 2 s at the step rank 1 is signalled, so it
    # reaches every later collective late.
    proc = _fit(tmp_path, "late", "--signal", "SIGTERM", "--signal-rank", "1", "--sleep-rank", "0")
    assert proc.returncode == 143, explain(proc)
    last = (tmp_path / "late" / "checkpoints" / "last").resolve()
    step = int(last.name.rsplit("=", 1)[1])
    assert step > 8, last.name
    assert f"rank 0 saved step {step} at {last}" in proc.stdout and f"rank 1 saved step {step} at {last}" in proc.stdout


def _fake_scontrol(folder: Path, record: Path, ckpt_root: Path) -> None:
    """An ``scontrol`` that records its arguments, the calling task's rank, and whether the
    checkpoint ``last`` was committed (its meta.json readable) when it was called."""
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f"committed=$(ls {ckpt_root}/*/version_*/checkpoints/last/meta.json >/dev/null 2>&1 && echo yes || echo no)\n"
        f'echo "$* rank=$SLURM_PROCID committed=$committed" >> {record}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _srun(
    tmp: Path, root: str, name: str, *extra: str, restart_count: int = 0
) -> list[subprocess.CompletedProcess[str]]:
    """Two tasks of one SLURM job step, with the variables ``srun`` sets."""
    port = find_free_port()
    procs = []
    for rank in (0, 1):
        task_env = {
            **env(),
            "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "train",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NODELIST": "localhost",
            "SLURM_RESTART_COUNT": str(restart_count),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        cmd = [sys.executable, SCRIPT, str(tmp / root), str(tmp / f"{name}.pt"), "--logger", *extra]
        procs.append(subprocess.Popen(cmd, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_slurm_usr1_requeues_once_after_the_save_and_the_restarted_job_resumes_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", "0")
    record = tmp_path / "scontrol.log"
    _fake_scontrol(tmp_path / "bin", record, tmp_path / "job")
    # SIGUSR1 (SLURM's --signal=USR1@90) to rank 0 only, at step 8.
    first = _srun(tmp_path, "job", "requeued", "--signal", "SIGUSR1", "--signal-rank", "0")
    for proc in first:
        assert proc.returncode == 0, explain(proc)  # requeued: the job goes on in its next allocation
    assert record.read_text().splitlines() == ["requeue 4242 rank=0 committed=yes"]
    assert "torchrig: SIGUSR1: stopped the run; saved step 9 as" in first[0].stdout, explain(first[0])
    assert "requeued the job" in first[0].stdout
    # The job's next run: SLURM_RESTART_COUNT=1 and no ckpt_path.
    second = _srun(tmp_path, "job", "requeued", restart_count=1)
    for proc in second:
        assert proc.returncode == 0, explain(proc)
    said = second[0].stdout
    assert "torchrig: restart 1 of this job: resuming from" in said and "version_0/checkpoints/last" in said, said
    assert "continues in epoch 1/2 after 3 batches, step 9" in said
    reference = _srun(tmp_path, "reference", "reference")
    assert all(proc.returncode == 0 for proc in reference), explain(reference[0])
    assert record.read_text().count("requeue") == 1
    same_weights(tmp_path / "reference.pt", tmp_path / "requeued.pt")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_rig_preempted_tells_every_rank_of_a_hand_written_loop_at_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", "0")
    proc = run([str(SCRIPTS / "preempt_rig.py"), str(tmp_path / "ckpt")], timeout=60)
    assert proc.returncode == 143, explain(proc)
    # Rank 1 was signalled after step 5; rig.preempted() says so on both ranks after step 6.
    assert "rank 0 stopped at step 6" in proc.stdout and "rank 1 stopped at step 6" in proc.stdout, explain(proc)
    assert (tmp_path / "ckpt" / "last").resolve().name == "step-6"
    assert "was never stopped" not in proc.stdout


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_to_torchrig_run_reaches_the_workers_which_save_and_it_exits_143(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    args = ["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", SCRIPT, str(tmp_path / "run")]
    extra = [str(tmp_path / "run.pt"), "--ready", str(ready), "--step-sleep", "0.05", "--epochs", "200"]
    proc = subprocess.Popen(
        [sys.executable, *args, *extra], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.terminate()  # SIGTERM to `torchrig run`, as a scheduler stopping the job step would
    out, err = proc.communicate(timeout=60)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == 143, explain(done)
    assert "stopped by SIGTERM (the workers' output above says what they saved)" in err, explain(done)
    last = (tmp_path / "run" / "checkpoints" / "last").resolve()
    step = int(last.name.rsplit("=", 1)[1])
    assert 3 <= step < 1200, last.name  # long before the end of the 200 epochs
    assert f"rank 0 saved step {step} at {last}" in out and f"rank 1 saved step {step} at {last}" in out, explain(done)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_sigkilled_worker_restarted_by_torchrig_run_resumes_the_fit_by_itself_bitwise(tmp_path: Path) -> None:
    # Checkpoints every 5 steps; rank 1 dies at step 13; the restart resumes from step 10 on its own.
    args = ["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", "--max-restarts", "1", SCRIPT]
    extra = ["--kill-at", "13", "--save-every", "5"]
    proc = run([*args, str(tmp_path / "k"), str(tmp_path / "k.pt"), *extra], timeout=120)
    assert proc.returncode == 0, explain(proc)
    # (torchrun's log names whichever failure it saw first: rank 1's SIGKILL, or rank 0 failing on
    # the lost connection a moment before it looked, so the script says when it kills itself.)
    assert "rank 1 SIGKILLs itself at step 13" in proc.stdout, explain(proc)
    assert "torchrig: restart 1 of this job: resuming from" in proc.stdout, explain(proc)
    assert "continues in epoch 1/2 after 4 batches, step 10" in proc.stdout, explain(proc)
    assert "rank 0 done at step 18" in proc.stdout, explain(proc)
    clean = _fit(tmp_path, "clean")
    assert clean.returncode == 0, explain(clean)
    same_weights(tmp_path / "clean.pt", tmp_path / "k.pt")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_ddp_spawn_workers_stop_together_and_the_launching_process_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", "0")
    proc = run([SCRIPT, str(tmp_path / "sp"), str(tmp_path / "sp.pt"), "--spawn", "--signal", "SIGTERM"], timeout=80)
    assert proc.returncode == 143, explain(proc)
    last = (tmp_path / "sp" / "checkpoints" / "last").resolve()
    assert last.name == "epoch=1-step=9", explain(proc)
    assert f"torchrig: SIGTERM: stopped the run; saved step 9 as {last}" in proc.stdout, explain(proc)
    assert "ProcessExitedException" not in proc.stderr, explain(proc)
