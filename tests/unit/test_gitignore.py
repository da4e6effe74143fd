"""The repository ignores what torchrig writes by default, and nothing it does not write."""

from __future__ import annotations

import inspect
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from torchrig.commands.demo import DEFAULT_ROOT
from torchrig.trainer.checkpointing import CHECKPOINTS
from torchrig.trainer.loggers import CSVLogger, TensorBoardLogger


def default_outputs() -> set[str]:
    """The top folders torchrig's defaults write into, relative to where a run starts."""
    names = {inspect.signature(cls.__init__).parameters["name"].default for cls in (CSVLogger, TensorBoardLogger)}
    return names | {CHECKPOINTS, Path(DEFAULT_ROOT).parts[0]}


def test_gitignore_lists_the_default_outputs_and_no_other_tools_folders() -> None:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert default_outputs() == {"torchrig_logs", "checkpoints", "runs"}
    for name in default_outputs():
        assert f"{name}/" in lines, name  # anywhere: a script run from examples/ writes there too
    assert not [line for line in lines if "lightning_logs" in line]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_git_ignores_files_written_there_but_not_the_sources() -> None:
    written = [f"{name}/version_0/metrics.csv" for name in default_outputs()]
    written.append("examples/torchrig_logs/version_0/checkpoints/last")
    sources = ["src/torchrig/checkpoint/core.py", "src/torchrig/trainer/checkpointing.py", "docs/checkpoints.md"]
    check = ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--verbose", "--non-matching"]
    out = subprocess.run([*check, *written, *sources], capture_output=True, text=True, check=False).stdout
    ignored = {line.split("\t")[1] for line in out.splitlines() if not line.startswith("::")}
    assert ignored == set(written), out
