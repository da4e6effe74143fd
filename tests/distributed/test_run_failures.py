"""``torchrig run`` shows the script's own error when it fails before ``Rig()`` (issue 15, item 12)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from dist_helpers import explain, run

from torchrig.commands.run import failure_summary


@pytest.mark.distributed
@pytest.mark.timeout(100)
def test_a_script_that_fails_before_rig_shows_its_error(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    # One rank fails (two tracebacks written at once can interleave character by character)
    script.write_text('import os\n\nimport torchrig\n\nif os.environ["RANK"] == "1":\n    raise ValueError("boom")\n')
    proc = run(["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", str(script)])
    assert proc.returncode == 1, explain(proc)
    assert f'File "{script}", line 6, in <module>' in proc.stderr, explain(proc)
    assert "ValueError: boom" in proc.stderr, explain(proc)
    assert "To enable traceback" not in proc.stderr + proc.stdout, explain(proc)
    assert "Root Cause" not in proc.stderr, explain(proc)  # torchrun's summary is replaced by one line
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"torchrig run: {script} failed: rank "), explain(proc)
    assert last.endswith(" failed first (exit code 1)"), explain(proc)


def test_the_summary_names_the_rank_the_exit_code_and_what_is_known() -> None:
    recorded = SimpleNamespace(exitcode=1, message={"message": "RuntimeError: boom", "extraInfo": {}})
    assert failure_summary(1, recorded) == "rank 1 failed first (exit code 1): RuntimeError: boom"
    killed = SimpleNamespace(exitcode=-9, message="Signal 9 (SIGKILL) received by PID 7")
    assert failure_summary(0, killed) == "rank 0 failed first (exit code -9): Signal 9 (SIGKILL) received by PID 7"
    unrecorded = SimpleNamespace(exitcode=2, message="To enable traceback see: https://pytorch.org/docs")
    assert failure_summary(0, unrecorded) == "rank 0 failed first (exit code 2)"
