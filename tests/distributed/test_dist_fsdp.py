"""FSDP2 (fully_shard) on 2 real processes (gloo): same weights as 1 process, also from meta."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, assert_matches_reference, explain, result, run

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_fsdp_two_processes_train_like_one(tmp_path: Path) -> None:
    # The optimizer is created after prepare, from the sharded parameters.
    out = tmp_path / "w.pt"
    proc = run(
        [str(SCRIPTS / "train.py"), "--out", str(out), "--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp"]
    )
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    assert info["strategy"] == "FSDPStrategy" and info["world_size"] == 2
    assert info["local_numel"] < info["numel"]  # rank 0 holds a shard, not the whole model
    assert_matches_reference(weights)


@pytest.mark.timeout(120)
def test_fsdp_empty_init_materialises_shards_and_trains_like_one(tmp_path: Path) -> None:
    # Parameters created on meta; the optimizer made before prepare is switched to the shards.
    out = tmp_path / "w.pt"
    proc = run(
        [
            str(SCRIPTS / "train.py"),
            "--out",
            str(out),
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--strategy",
            "fsdp",
            "--empty-init",
        ]
    )
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    assert info["local_numel"] < info["numel"]
    assert_matches_reference(weights)
