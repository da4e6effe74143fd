"""The distributed examples run as documented (2 CPU processes each)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dist_helpers import explain, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_ddp_example_trains_and_counts_every_validation_sample_once() -> None:
    proc = run([str(EXAMPLES / "ddp.py"), "--epochs", "2"])
    assert proc.returncode == 0, explain(proc)
    assert "world_size=2" in proc.stdout, explain(proc)
    # 501 validation samples on 2 ranks: the padded duplicate is dropped by gather_for_metrics
    assert re.search(r"epoch 1: train loss \d\.\d+  val accuracy \d\.\d+ \(501 samples\)", proc.stdout), explain(proc)


@pytest.mark.timeout(120)
def test_fsdp_example_trains_from_meta(tmp_path: Path) -> None:
    proc = run([str(EXAMPLES / "fsdp.py"), "--epochs", "2", "--out", str(tmp_path)])
    assert proc.returncode == 0, explain(proc)
    losses = [float(x) for x in re.findall(r"epoch \d: loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], explain(proc)
    assert re.search(r"sharded checkpoint fsdp-last consolidated: \d+ tensors, \d+ parameters", proc.stdout), explain(
        proc
    )
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "fsdp-last" / "meta.json").is_file()
