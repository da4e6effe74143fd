"""The distributed examples run as documented (2 CPU processes each)."""

from __future__ import annotations

import json
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


VIEW_WARNING = "returned a view tensor"  # FSDP2's warning about a sharded module's output


@pytest.mark.timeout(120)
def test_fsdp_example_trains_from_meta(tmp_path: Path) -> None:
    proc = run([str(EXAMPLES / "fsdp.py"), "--epochs", "2", "--out", str(tmp_path)])
    assert proc.returncode == 0, explain(proc)
    losses = [float(x) for x in re.findall(r"epoch \d: loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], explain(proc)
    counted = re.search(r"sharded checkpoint fsdp-last consolidated: \d+ tensors, (\d+) parameters", proc.stdout)
    assert counted, explain(proc)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "fsdp-last" / "meta.json").is_file()
    meta = json.loads((tmp_path / "fsdp-last" / "meta.json").read_text())
    assert (meta["parameters"], meta["buffers"]) == (int(counted[1]), 0)  # the full model's, from 2 shards
    assert VIEW_WARNING not in proc.stderr, explain(proc)


@pytest.mark.timeout(120)
def test_fsdp_example_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as documented (no --out) from a folder, it leaves nothing there, nor in the temp dir."""
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(), temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    proc = run([str(EXAMPLES / "fsdp.py"), "--epochs", "1"], cwd=cwd)
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"sharded checkpoint fsdp-last consolidated: \d+ tensors", proc.stdout), explain(proc)
    removed = re.search(r"^removed (\S+) \(pass --out DIR to keep the checkpoint\)$", proc.stdout, re.M)
    assert removed and Path(removed[1]).parent == temp, explain(proc)
    assert not any(cwd.iterdir())
    assert not list(temp.glob("torchrig-fsdp-*"))  # torch may keep its own caches there
    assert VIEW_WARNING not in proc.stderr, explain(proc)
