"""The Rig's API takes what real models hand it: ``torch.compile`` of a prepared module, and
values computed from FSDP/tensor-parallel parameters (DTensors), on 2 gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_helpers import SCRIPTS, explain, run

pytestmark = pytest.mark.distributed


def launch(tmp_path: Path, part: str) -> dict[str, object]:
    out = tmp_path / "r.json"
    proc = run([str(SCRIPTS / "compiled_dtensor.py"), "--out", str(out), "--part", part], timeout=110)
    assert proc.returncode == 0, explain(proc)
    return json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_no_backward_sync_takes_the_compiled_prepared_module(tmp_path: Path) -> None:
    report = launch(tmp_path, "sync")
    # x = (r+1, r+1, r+1): rank r's own gradient is x; inside the block DDP did not average them
    assert report["own"] == [[[1.0, 1.0, 1.0]], [[2.0, 2.0, 2.0]]]
    assert report["synced"] == [[[1.5, 1.5, 1.5]], [[1.5, 1.5, 1.5]]]  # outside it, it did


@pytest.mark.timeout(120)
def test_all_gather_and_all_reduce_of_a_dtensor_use_the_full_tensor(tmp_path: Path) -> None:
    report = launch(tmp_path, "gather")
    assert report["is_dtensor"] == "DTensor"
    full = torch.tensor(report["full"])
    assert torch.equal(torch.tensor(report["gathered"]), torch.stack([full * 2, full * 2]))  # (world, *full shape)
    assert torch.allclose(torch.tensor(report["reduced"]), full * 2 * 2)  # the full value summed over 2 ranks
