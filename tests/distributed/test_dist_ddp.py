"""DDP on 2 real processes (gloo): same weights as 1 process; a failing rank stops everyone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, assert_matches_reference, explain, result, run

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_ddp_two_processes_train_like_one(tmp_path: Path) -> None:
    # `python train.py` with strategy="ddp": this process becomes rank 0 and starts rank 1.
    out = tmp_path / "w.pt"
    proc = run(
        [str(SCRIPTS / "train.py"), "--out", str(out), "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp"]
    )
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    assert info["world_size"] == 2 and info["strategy"] == "DDPStrategy"
    # module_state_dict gives the user's keys, without DistributedDataParallel's "module." prefix
    assert info["keys"] == ["body.0.bias", "body.0.weight", "head.bias", "head.weight"]
    assert_matches_reference(weights)


@pytest.mark.timeout(120)
def test_a_failing_rank_stops_every_rank_and_is_named(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = run([str(SCRIPTS / "fail.py")], timeout=100)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, explain(proc)
    assert "rank 1 of 2 failed with RuntimeError: boom on purpose at step 3" in proc.stderr, explain(proc)
    assert "rank 1 (exit code 1)" in proc.stderr, explain(proc)
    assert "was never stopped" not in proc.stdout
    assert elapsed < 90  # well inside the process-group timeout (30 s) plus start-up
