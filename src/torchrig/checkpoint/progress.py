"""How far training had got when each checkpoint of a folder was saved: what retention and the
choice among interrupted copies order by (the step, then the order of saves; never a clock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
