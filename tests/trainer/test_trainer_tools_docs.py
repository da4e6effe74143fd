"""docs/trainer_tools.md as written: the profiler, model summary and hyperparameter examples run
and print what the text says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, run_example

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


@pytest.mark.timeout(160)
def test_the_simple_profiler_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = section('### `profiler="simple"`')
    (code,) = blocks(text, "python")
    out = run_example(code, "docs/trainer_tools.md", tmp_path, capsys)
    assert "SimpleProfiler: 48 steps in" in out and out.rstrip().endswith("True")
    shown = blocks(text, "")[0]  # the table the docs show: the same rows
    for row in ("data loading", "training_step (forward)", "backward", "optimizer step", "validation", "other"):
        assert f"│ {row} " in shown and f"│ {row} " in out, row
    assert "SimpleProfiler: 48 steps in" in shown
    # The model summary section shows this example's summary as it prints.
    summary = blocks(section("## Model summary"), "")[0]
    assert stripped(summary) in stripped(out)


@pytest.mark.timeout(160)
def test_the_pytorch_profiler_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = blocks(section('### `profiler="pytorch"`'), "python")
    out = run_example(code, "docs/trainer_tools.md", tmp_path, capsys)
    assert "PyTorchProfiler: top 5 operators by self time" in out
    assert out.rstrip().endswith("['chrome_trace_rank0.json', 'tensorboard']")


@pytest.mark.timeout(160)
def test_the_hyperparameters_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = blocks(section("## Hyperparameters"), "python")
    out = run_example(code, "docs/trainer_tools.md", tmp_path, capsys)
    assert out.splitlines()[-2:] == ["{'hidden': 8, 'lr': 0.01, 'activations': ('tanh',)}", "True"]
