"""The Trainer's arguments that need more than a range check: batch limits, ``max_time``, and
the callbacks and loggers it builds from ``callbacks``/``logger`` and the ``enable_*`` switches."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from torchrig import arguments
from torchrig.trainer.callbacks import Callback
from torchrig.trainer.checkpointing import ModelCheckpoint
from torchrig.trainer.logger_base import Logger
from torchrig.trainer.loggers import CSVLogger
from torchrig.trainer.progress import ProgressBar

#: Seconds between the saves of the default checkpoint (each epoch's end, at most this often, and the end).
DEFAULT_CHECKPOINT_INTERVAL = 60.0


def batch_limit(name: str, value: Any, allow_zero: bool = True) -> int | float:
    """An int count of batches, or a float fraction in [0, 1]."""
    low = 0 if allow_zero else 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        return value
    if isinstance(value, float) and 0.0 <= value <= 1.0 and (allow_zero or value > 0):
        return value
    raise ValueError(
        f"{name}={value!r}: give an int number of batches (>= {low}) or a float fraction of the epoch in "
        f"{'[0.0' if allow_zero else '(0.0'}, 1.0]"
    )


_TIME_FORMS = ": give seconds (> 0), a datetime.timedelta, or 'DD:HH:MM:SS'"


def parse_time(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return arguments.finite_at_least("max_time", value, 0.0, strict=True, hint=_TIME_FORMS)
    if isinstance(value, str):
        parts = value.split(":")
        # ASCII digits only ('²'.isdigit() is True, int('²') fails), and few enough for a float
        if len(parts) == 4 and all(p.isascii() and p.isdigit() and len(p) <= 12 for p in parts):
            d, h, m, s = (int(p) for p in parts)
            return float(((d * 24 + h) * 60 + m) * 60 + s)
    raise ValueError(f"max_time={arguments.shown(value)}{_TIME_FORMS}")


def callbacks(given: Any, checkpointing: bool, progress_bar: bool) -> list[Callback]:
    found: list[Callback] = (
        [] if given is None else arguments.instances("callbacks", given, Callback, "torchrig Callback objects")
    )
    has_ckpt = any(isinstance(c, ModelCheckpoint) for c in found)
    if has_ckpt and not checkpointing:
        raise ValueError("enable_checkpointing=False, but a ModelCheckpoint is in callbacks; drop one of the two")
    if checkpointing and not has_ckpt:
        found.append(ModelCheckpoint(save_last=True, train_time_interval=DEFAULT_CHECKPOINT_INTERVAL))
    if progress_bar and not any(isinstance(c, ProgressBar) for c in found):
        found.insert(0, ProgressBar())
    # Checkpoints go last so they see what every other callback did at the same event.
    return [c for c in found if not isinstance(c, ModelCheckpoint)] + [
        c for c in found if isinstance(c, ModelCheckpoint)
    ]


def loggers(given: Any, root: Path) -> list[Logger]:
    if given is True:
        return [CSVLogger(root_dir=root)]
    if given is False or given is None:
        return []
    return arguments.instances("logger", given, Logger, "a torchrig Logger, a list of them, True or False")
