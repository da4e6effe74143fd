"""Checkpoint misuse across processes is reported plainly and quickly (issue 14, section 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, explain, run

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_save_on_rank_zero_only_says_every_rank_must_call_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHRIG_SAVE_ARRIVAL_TIMEOUT", "3")  # the default is 60 s; the process group's 60 s
    proc = run([str(SCRIPTS / "rank0_save.py"), str(tmp_path)], timeout=100)
    assert proc.returncode == 0, explain(proc)
    assert (
        f"rank 0 error: rig.save('{tmp_path / 'ck'}') was not called on rank(s) [1] within 3 s of rank 0: "
        "every rank must call rig.save"
    ) in proc.stdout, explain(proc)
    assert "saved step 2" in proc.stdout, explain(proc)
