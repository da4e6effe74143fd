"""How far training had got when each checkpoint of a folder was saved: what retention and the
choice among interrupted copies order by (the step, then the order of saves; never a clock)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from torchrig.checkpoint.reading import read_meta_quiet


def progress(meta: dict[str, Any] | None) -> tuple[int, float, int]:
    """How far training had got when a checkpoint was saved, for ordering: its step (a checkpoint
    with no numeric step ranks below every one with a step), then its ``save_count``; never a clock
    (a requeued job's node may be hours behind). ``None`` (no valid ``meta.json``) ranks lowest."""
    if meta is None:
        return (-1, 0.0, 0)
    step = meta.get("step")
    count = int(meta.get("save_count", 0))
    if isinstance(step, (int, float)) and not isinstance(step, bool) and step == step:  # not NaN
        return (1, float(step), count)
    return (0, 0.0, count)


_Where = TypeVar("_Where")


def next_save_count(metas: Iterable[dict[str, Any]]) -> int:
    """The ``save_count`` of a new checkpoint: one more than any of ``metas`` (those beside it) has."""
    return max((int(m.get("save_count", 0)) for m in metas), default=0) + 1


def least_advanced(found: Iterable[tuple[dict[str, Any] | None, _Where]], keep_last: int) -> list[_Where]:
    """What ``keep_last`` removes of the checkpoints ``found`` beside a new one (each with its
    ``meta.json`` and where it is): those least far in training (:func:`progress`), so that
    ``keep_last`` remain counting the new one. The one order of retention, on a disk or on object
    storage."""
    ranked = sorted(found, key=lambda f: progress(f[0]))
    return [where for _, where in ranked[: max(0, len(ranked) - (keep_last - 1))]]


def checkpoints_beside(target: Path) -> list[tuple[dict[str, Any], Path]]:
    """The torchrig checkpoints next to ``target`` (visible real directories with a valid ``meta.json``,
    ``target`` itself left out) with their ``meta.json``."""
    if not target.parent.is_dir():
        return []
    found = []
    for p in target.parent.iterdir():
        if p.name.startswith(".") or p.is_symlink() or not p.is_dir() or p == target:
            continue
        meta = read_meta_quiet(p)
        if meta is not None:
            found.append((meta, p))
    return found
