"""Shared fixtures: every test starts from a known seed and leaves no process group behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "TORCHRIG_ACCELERATOR",
        "TORCHRIG_DEVICES",
        "TORCHRIG_STRATEGY",
        "TORCHRIG_PRECISION",
        "TORCHRIG_NUM_NODES",
    ):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)


def python_env() -> dict[str, str]:
    """The environment for subprocesses: this interpreter, torchrig importable, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable
