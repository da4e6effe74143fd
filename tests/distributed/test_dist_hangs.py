"""A collective that times out names what every rank was doing (2 real processes on gloo)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from dist_helpers import SCRIPTS, explain, run

import torchrig
from torchrig.arguments import timeout as as_timeout
from torchrig.strategies.hangs import CollectiveTimeoutError, collective


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_skipped_all_reduce_names_both_collectives() -> None:
    # Rig(timeout=10); rank 0 skips the second all_reduce and waits in barrier("end")
    proc = run(["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", str(SCRIPTS / "desync.py")])
    assert proc.returncode == 1, explain(proc)
    assert "a collective timed out after 10 s" in proc.stderr and "Timed out waiting 10000ms" in proc.stderr
    assert "rank 0 is in barrier('end') (its collective #2) from desync.py:25" in proc.stderr, explain(proc)
    assert "rank 1 is in all_reduce('sum') (its collective #2) from desync.py:24" in proc.stderr, explain(proc)
    assert "did not report" not in proc.stderr and "finished" not in proc.stdout, explain(proc)


def test_only_timeouts_are_explained() -> None:
    # no process group here: the other ranks cannot be asked
    with pytest.raises(CollectiveTimeoutError) as info, collective("all_reduce('sum')", 0, 2, timedelta(seconds=0.2)):
        raise RuntimeError("Timed out waiting 200ms for recv operation to complete")
    text = str(info.value)
    assert "rank 0 is in all_reduce('sum')" in text and "from test_dist_hangs.py:" in text, text
    assert "rank 1 did not report" in text and "the other ranks could not be asked" in text, text
    assert "The backend said: Timed out waiting 200ms" in text, text
    # not a timeout: raised unchanged
    with pytest.raises(RuntimeError, match=r"^Connection closed by peer$"), collective("barrier", 0, 2, timedelta(1)):
        raise RuntimeError("Connection closed by peer")


def test_timeout_setting_is_checked() -> None:
    assert as_timeout(10) == timedelta(seconds=10) == as_timeout(timedelta(seconds=10))
    with pytest.raises(ValueError, match="timeout=0 must be positive"):
        as_timeout(0)
    with pytest.raises(TypeError, match="timeout='10' must be seconds"):
        as_timeout("10")
    with pytest.raises(ValueError, match="timeout=-1 must be positive"):
        torchrig.Rig(accelerator="cpu", timeout=-1)
    with pytest.raises(ValueError, match="timeout=-1 must be positive"):  # the Trainer passes it to its Rig
        torchrig.Trainer(accelerator="cpu", timeout=-1, logger=False)
