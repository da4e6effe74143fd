"""Retention ranks checkpoints by training progress, never by clocks (issue 28, item 6), in a local
folder and on object storage alike (issue 31: one order for both, ``progress.least_advanced``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch import nn

import torchrig


@pytest.fixture(params=["local", "memory"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the checkpoints go: a local folder, or a folder on fsspec's in-memory object store."""
    if request.param == "local":
        return str(tmp_path)
    return str(request.getfixturevalue("memory_url"))


def _names(folder: str) -> list[str]:
    """The checkpoint names in ``folder`` (not the ``last`` link or object, not hidden entries)."""
    if folder.startswith("memory://"):
        import fsspec

        entries = fsspec.filesystem("memory").ls(folder.removeprefix("memory://"), detail=True)
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory"]
    else:
        names = [p.name for p in Path(folder).iterdir() if not p.is_symlink()]
    return sorted(n for n in names if not n.startswith("."))


def _behind(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - int(seconds * 1e9))


_MODEL = nn.Linear(2, 2)
pytestmark = pytest.mark.timeout(30)


def _save(path: str, step: int | None, keep_last: int | None = None) -> None:
    state: dict[str, object] = {"model": _MODEL} if step is None else {"model": _MODEL, "step": step}
    torchrig.Rig(accelerator="cpu").save(path, state, keep_last=keep_last)


def test_keep_last_keeps_the_newest_steps_when_a_node_clock_is_behind(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2, 3, 4, 5):
        if step == 4:
            _behind(monkeypatch, 3600)  # requeued on a node whose clock is an hour behind
        _save(f"{folder}/step-{step}", step, keep_last=2)
    assert _names(folder) == ["step-4", "step-5"]
    assert torchrig.checkpoint.read_values(f"{folder}/last")["step"] == 5


def test_at_the_same_step_the_later_save_is_kept_whatever_the_clock(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(f"{folder}/a", 3)
    _behind(monkeypatch, 3600)
    _save(f"{folder}/b", 3)  # saved later, its clock says earlier
    _save(f"{folder}/c", 3, keep_last=2)
    assert _names(folder) == ["b", "c"]
    counts = [torchrig.checkpoint.describe(f"{folder}/{n}")["save_count"] for n in ("b", "c")]
    assert counts == [2, 3]


def test_checkpoints_without_a_step_are_ranked_by_the_order_they_were_saved(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i, name in enumerate(["x", "y", "z"]):
        _behind(monkeypatch, 600 * i)  # each clock further behind than the last
        _save(f"{folder}/{name}", None, keep_last=2)
    assert _names(folder) == ["y", "z"]


def test_a_name_saved_again_after_the_clock_went_back_is_replaced(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(f"{folder}/ck", 1)
    _behind(monkeypatch, 3600)
    _save(f"{folder}/ck", 2)  # on object storage: a new version under ck, its clock an hour earlier
    assert torchrig.checkpoint.read_values(f"{folder}/ck")["step"] == 2
    assert torchrig.checkpoint.read_values(f"{folder}/last")["step"] == 2
    if folder.startswith("memory://"):
        import fsspec

        assert len(fsspec.filesystem("memory").ls(f"{folder.removeprefix('memory://')}/ck")) == 1  # the old one went
