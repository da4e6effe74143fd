"""Background saves on 2 processes (issue 16, section 4): DDP (rank 0 writes, every rank learns its
outcome through the store) and FSDP (DCP's async_save in thread mode on a group of its own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dist_helpers import SCRIPTS, explain, run

pytestmark = pytest.mark.distributed


def _results(mode: str, tmp_path: Path) -> dict[int, dict[str, Any]]:
    (tmp_path / "ck").mkdir()
    (tmp_path / "out").mkdir()
    proc = run([str(SCRIPTS / "async_save.py"), mode, str(tmp_path / "ck"), str(tmp_path / "out")], timeout=110)
    assert proc.returncode == 0, explain(proc)
    return {rank: json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.timeout(120)
def test_ddp_background_save_holds_the_state_of_the_call_and_rank_0_errors_reach_every_rank(tmp_path: Path) -> None:
    results = _results("ddp", tmp_path)
    for rank in (0, 1):
        assert results[rank]["step"] == 1 and results[rank]["same"], results[rank]
        # The failed save left nothing; the save after it was refused on every rank.
        assert results[rank]["dirs"] == ["a", "last"], results[rank]
    disk = f"CheckpointError: no space left on device at {tmp_path / 'ck' / 'b'}: the checkpoint needs about"
    assert results[0]["error"].startswith(disk), results[0]
    assert results[1]["error"].startswith(
        f"RuntimeError: rank 0 failed to save the checkpoint {tmp_path / 'ck' / 'b'}: {disk}"
    ), results[1]


@pytest.mark.timeout(120)
def test_fsdp_background_save_through_dcp_holds_the_state_of_the_call(tmp_path: Path) -> None:
    results = _results("fsdp", tmp_path)
    assert results[1]["step"] == 1 and results[1]["sharded"], results[1]
    zero = results[0]  # the full state dict is gathered on rank 0
    assert zero["step"] == 1 and zero["sharded"], zero
    assert zero["same"] and zero["moved"], zero  # loaded = the state of the call, not the one after
    assert zero["second"], zero  # a second background save loads as its own state
