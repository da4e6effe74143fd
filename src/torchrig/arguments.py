"""The validators behind every argument the Trainer and the Rig refuse.

Each takes the argument's name and value and either returns the value in its checked form or
raises ``ValueError``/``TypeError`` whose message starts with ``name=value``. They run once, when
the argument is given, never per step.

A value of the wrong type raises :class:`ArgumentTypeError`: a ``TypeError`` that is also a
``ValueError``, because several arguments reported a wrong type as ``ValueError`` before they
shared these validators, and code that catches that keeps working.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

# The seeds torch.manual_seed accepts.
SEED_RANGE = (-(2**63), 2**64 - 1)


def shown(value: Any) -> str:
    """``repr(value)``, shortened for huge values such as ``10**400``."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"<int of {len(str(value))} digits>"
    return text if len(text) <= 80 else text[:77] + "..."


INT64_MAX = 2**63 - 1


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError``, and a ``ValueError`` for older callers)."""


def int_in_range(name: str, value: Any, low: int, high: int = INT64_MAX, hint: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (by default, what an int64 holds); bools refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name}={shown(value)} must be an int, not {type(value).__name__}{hint}")
    if value < low or value > high:
        bound = f">= {low}" if high == INT64_MAX and value < low else f"in [{low}, {high}]"
        raise ValueError(f"{name}={shown(value)} must be an int {bound}{hint}")
    return value


def as_float(value: int | float) -> float:
    """``float(value)``, with ints too large for a float as ``inf`` (``float`` raises OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def finite_at_least(name: str, value: Any, low: float = 0.0, *, strict: bool = False, hint: str = "") -> float:
    """``value`` as a finite float ``>= low`` (``> low`` when ``strict``); refuses nan, inf and overflow."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name}={shown(value)} must be a number, not {type(value).__name__}{hint}")
    number = as_float(value)
    op = ">" if strict else ">="
    if not math.isfinite(number) or number < low or (strict and number == low):
        raise ValueError(f"{name}={shown(value)} must be a finite number {op} {low:g}{hint}")
    return number


def clip_threshold(name: str, value: Any) -> float:
    """A gradient-clipping threshold: a finite number >= 0 (nan, inf and negatives would ruin the weights)."""
    return finite_at_least(name, value, 0.0, hint="; pass None for no clipping")


def seed(name: str, value: Any) -> int:
    """A seed torch accepts: an int in ``SEED_RANGE``."""
    return int_in_range(name, value, *SEED_RANGE)


def path(name: str, value: Any) -> str | os.PathLike[str]:
    """A filesystem path: ``str`` or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={shown(value)} must be a path (str or os.PathLike), not {type(value).__name__}")
    return value


def file_in_the_way(path_: str | os.PathLike[str]) -> Path | None:
    """The first of ``path_`` and its parents that exists and is not a directory (so no directory
    can be made at ``path_``), or None."""
    p = Path(path_)
    return next((q for q in (p, *p.parents) if os.path.lexists(q) and not q.is_dir()), None)


def directory(name: str, value: Any, hint: str = "") -> str | os.PathLike[str]:
    """A local path where a directory is, or can be made: neither it nor a parent is a file."""
    blocking = file_in_the_way(path(name, value))
    if blocking is not None:
        raise ValueError(
            f"{name}={os.fspath(value)!r} must be a directory, but {blocking} exists and is not one; pass a folder, "
            f"or a path that does not exist yet{hint}"
        )
    return value


def instances(name: str, value: Any, kind: type, what: str) -> list[Any]:
    """One ``kind`` or an iterable of them, as a list; anything else is a TypeError naming ``name``."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    found = list(value)
    bad = [type(item).__name__ for item in found if not isinstance(item, kind)]
    if bad:
        raise TypeError(f"{name} must be {what}; got {', '.join(bad)}")
    return found


def timeout(value: Any) -> timedelta:
    """``timeout=`` as a timedelta: seconds (int or float > 0) or a positive timedelta."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = as_float(value)
    else:
        raise TypeError(f"timeout={value!r} must be seconds (a number) or a datetime.timedelta")
    if not seconds > 0:
        raise ValueError(f"timeout={shown(value)} must be positive")
    if seconds > _MOST_SECONDS:
        raise ValueError(f"timeout={shown(value)} is longer than a timedelta holds ({_MOST_SECONDS:g} s)")
    return timedelta(seconds=seconds)


_MOST_SECONDS = timedelta.max.total_seconds() - 86400.0
