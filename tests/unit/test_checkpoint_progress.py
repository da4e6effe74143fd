"""Retention ranks checkpoints by training progress, never by clocks (issue 28, item 6)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch import nn

import torchrig


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and not p.is_symlink())


def _behind(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - int(seconds * 1e9))


_MODEL = nn.Linear(2, 2)


def _save(path: Path, step: int | None, keep_last: int | None = None) -> None:
    state: dict[str, object] = {"model": _MODEL} if step is None else {"model": _MODEL, "step": step}
    torchrig.Rig(accelerator="cpu").save(path, state, keep_last=keep_last)


@pytest.mark.timeout(30)
def test_keep_last_keeps_the_newest_steps_when_a_node_clock_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2, 3, 4, 5):
        if step == 4:
            _behind(monkeypatch, 3600)  # requeued on a node whose clock is an hour behind
        _save(tmp_path / f"step-{step}", step, keep_last=2)
    assert _names(tmp_path) == ["step-4", "step-5"]
    assert torchrig.checkpoint.read_values(tmp_path / "last")["step"] == 5


@pytest.mark.timeout(30)
def test_at_the_same_step_the_later_save_is_kept_whatever_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path / "a", 3)
    _behind(monkeypatch, 3600)
    _save(tmp_path / "b", 3)  # saved later, its clock says earlier
    _save(tmp_path / "c", 3, keep_last=2)
    assert _names(tmp_path) == ["b", "c"]
    counts = [torchrig.checkpoint.describe(tmp_path / n)["save_count"] for n in ("b", "c")]
    assert counts == [2, 3]


@pytest.mark.timeout(30)
def test_checkpoints_without_a_step_are_ranked_by_the_order_they_were_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i, name in enumerate(["x", "y", "z"]):
        _behind(monkeypatch, 600 * i)  # each clock further behind than the last
        _save(tmp_path / name, None, keep_last=2)
    assert _names(tmp_path) == ["y", "z"]
