"""Checkpoint misuse across processes is reported plainly and quickly (issue 14, section 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, explain, run

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_save_on_rank_zero_only_says_every_rank_must_call_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHRIG_SAVE_ARRIVAL_TIMEOUT", "2")  # the default is 60 s; the process group's is 8 s
    proc = run([str(SCRIPTS / "rank0_save.py"), str(tmp_path), "never"], timeout=100)
    assert proc.returncode == 0, explain(proc)
    assert "rank 0 has waited 2 s in rig.save(" in proc.stderr, explain(proc)
    assert "for rank(s) [1]: every rank must call rig.save" in proc.stderr, explain(proc)
    assert (
        f"rank 0 error: rig.save('{tmp_path / 'ck'}') was not called on rank(s) [1] within 8 s (the process "
        "group's timeout) of rank 0: every rank must call rig.save"
    ) in proc.stdout, explain(proc)
    assert not (tmp_path / "ck").exists()


@pytest.mark.timeout(120)
def test_a_rank_that_is_only_late_to_save_gets_a_warning_and_the_save_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRIG_SAVE_ARRIVAL_TIMEOUT", "1")
    proc = run([str(SCRIPTS / "rank0_save.py"), str(tmp_path), "late"], timeout=100)
    assert proc.returncode == 0, explain(proc)
    assert "has waited 1 s in rig.save(" in proc.stderr, explain(proc)
    assert "saved step 2" in proc.stdout, explain(proc)
