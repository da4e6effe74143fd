"""Checkpoints (placeholder until the checkpoint issue lands)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save(rig: Any, path: str | os.PathLike[str], state: dict[str, Any], **kwargs: Any) -> Path:
    raise NotImplementedError("checkpoints are not built yet")


def load(
    rig: Any, path: str | os.PathLike[str], state: dict[str, Any] | None = None, strict: bool = True
) -> dict[str, Any]:
    raise NotImplementedError("checkpoints are not built yet")
