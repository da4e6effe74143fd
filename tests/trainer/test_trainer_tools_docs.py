"""docs/trainer_tools.md as written: the profiler, model summary and hyperparameter examples run
and print what the text says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, python_env

DOCS = (ROOT / "docs" / "trainer_tools.md").read_text()


def section(heading: str) -> str:
    """The text under ``heading`` (a ``##`` or ``###`` heading) up to the next heading of its level or above."""
    level = len(heading.split(" ", 1)[0])
    start = DOCS.index(f"\n{heading}\n")
    end = re.compile(rf"\n#{{1,{level}}} ").search(DOCS, start + 1)
    return DOCS[start : end.start() if end else len(DOCS)]


def blocks(text: str, kind: str) -> list[str]:
    """The fenced blocks of ``text`` opened with ```` ```kind ```` (``""``: a plain fence)."""
    found: list[str] = []
    fence: str | None = None  # the opening line of the block we are in
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, lines = line.strip(), []
        elif fence is not None and line.startswith("```"):
            if fence == f"```{kind}":
                found.append("".join(lines))
            fence = None
        else:
            lines.append(line)
    return found


def stripped(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines())


def run_block(code: str, cwd: Path) -> str:
    done = subprocess.run([PYTHON, "-c", code], cwd=cwd, env=python_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(160)
def test_the_simple_profiler_example(tmp_path: Path) -> None:
    text = section('### `profiler="simple"`')
    (code,) = blocks(text, "python")
    out = run_block(code, tmp_path)
    assert "SimpleProfiler: 48 steps in" in out and out.rstrip().endswith("True")
    shown = blocks(text, "")[0]  # the table the docs show: the same rows
    for row in ("data loading", "training_step (forward)", "backward", "optimizer step", "validation", "other"):
        assert f"│ {row} " in shown and f"│ {row} " in out, row
    assert "SimpleProfiler: 48 steps in" in shown
    # The model summary section shows this example's summary as it prints.
    summary = blocks(section("## Model summary"), "")[0]
    assert stripped(summary) in stripped(out)


@pytest.mark.timeout(160)
def test_the_pytorch_profiler_example(tmp_path: Path) -> None:
    (code,) = blocks(section('### `profiler="pytorch"`'), "python")
    out = run_block(code, tmp_path)
    assert "PyTorchProfiler: top 5 operators by self time" in out
    assert out.rstrip().endswith("['chrome_trace_rank0.json', 'tensorboard']")


@pytest.mark.timeout(160)
def test_the_hyperparameters_example(tmp_path: Path) -> None:
    (code,) = blocks(section("## Hyperparameters"), "python")
    out = run_block(code, tmp_path)
    assert out.splitlines()[-2:] == ["{'hidden': 8, 'lr': 0.01, 'activations': ('tanh',)}", "True"]
