"""``torchrig run --max-restarts``: a killed worker costs only the steps since the last checkpoint,
and a restart that makes no progress stops the job instead of spending the other restarts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from dist_helpers import SCRIPTS, explain, run

from torchrig.commands.run import torchrun_args

SCRIPT = str(SCRIPTS / "restart_fit.py")


def _run(tmp: Path, name: str, *extra: str, restarts: int) -> tuple[object, Path]:
    out = tmp / f"{name}.pt"
    args = ["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", "--max-restarts", str(restarts)]
    proc = run([*args, SCRIPT, "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(out), *extra], timeout=150)
    return proc, out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_sigkilled_worker_is_restarted_and_resumes_bitwise(tmp_path: Path) -> None:
    proc, out = _run(tmp_path, "killed", "--kill-at", "13", restarts=1)
    assert proc.returncode == 0, explain(proc)
    # rank 1 died at step 13; the restart resumed from the checkpoint of step 10
    assert "attempt 0 starts at step 0" in proc.stdout and "attempt 1 starts at step 10" in proc.stdout, explain(proc)
    # (torchrun's log names whichever failure it saw first: rank 1's SIGKILL or rank 0's lost connection)
    assert "rank 1 SIGKILLs itself at step 13" in proc.stdout, explain(proc)
    ref_proc, ref_out = _run(tmp_path, "reference", restarts=0)
    assert ref_proc.returncode == 0, explain(ref_proc)
    weights, ref = torch.load(out), torch.load(ref_out)
    assert sorted(weights) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(weights[key], value), key


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_restart_without_progress_stops_the_job(tmp_path: Path) -> None:
    # rank 1 fails at step 2 of every attempt, before the first checkpoint (step 5)
    proc, _ = _run(tmp_path, "loop", "--fail-at", "2", restarts=5)
    assert proc.returncode == 1, explain(proc)
    assert (
        "stopped: restart 1 committed no checkpoint before it failed, like the attempt before it, so restarting "
        "again would repeat it; the job stops here. Restart 1 failed with rank 1: RuntimeError: boom on purpose "
        "at step 2" in proc.stderr
    ), explain(proc)
    # the first run and one restart trained; the other four restarts were not spent
    assert "attempt 1 starts" in proc.stdout and "attempt 2 starts" not in proc.stdout, explain(proc)
    assert "attempt 3" not in proc.stdout + proc.stderr, explain(proc)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_restart_without_progress_after_an_attempt_that_made_some_is_restarted(tmp_path: Path) -> None:
    # Attempt 0 commits steps 5 and 10 and is killed at 13; restart 1 fails at step 12, before its
    # first checkpoint; restart 2 must still run (only two attempts in a row without progress stop).
    proc, out = _run(tmp_path, "once", "--kill-at", "13", "--fail-at", "12", "--fail-attempt", "1", restarts=3)
    assert proc.returncode == 0, explain(proc)
    assert "committed no checkpoint" not in proc.stderr, explain(proc)
    for attempt in range(3):
        assert f"attempt {attempt} starts at step {10 if attempt else 0}" in proc.stdout, explain(proc)
    ref_proc, ref_out = _run(tmp_path, "reference", restarts=0)
    assert ref_proc.returncode == 0, explain(ref_proc)
    weights, ref = torch.load(out), torch.load(ref_out)
    assert all(torch.equal(weights[k], v) for k, v in ref.items())


def test_max_restarts_reaches_torchrun_and_is_checked() -> None:
    base = {
        "devices": "2",
        "num_nodes": 1,
        "node_rank": 0,
        "master_addr": None,
        "master_port": None,
        "script": "s.py",
        "script_args": [],
    }
    assert "--max-restarts=3" in torchrun_args(argparse.Namespace(**base, max_restarts=3), 2)
    with pytest.raises(ValueError, match="--max-restarts -1 must be 0 or more"):
        torchrun_args(argparse.Namespace(**base, max_restarts=-1), 2)
