"""The Trainer's arguments that need more than a range check: batch limits, ``max_time``, and
the callbacks and loggers it builds from ``callbacks``/``logger`` and the ``enable_*`` switches."""

from __future__ import annotations

import datetime
import difflib
import inspect
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


def parse_time(value: Any, name: str = "max_time") -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return arguments.finite_at_least(name, value, 0.0, strict=True, hint=_TIME_FORMS)
    if isinstance(value, str):
        parts = value.split(":")
        # ASCII digits only ('²'.isdigit() is True, int('²') fails), and few enough for a float
        if len(parts) == 4 and all(p.isascii() and p.isdigit() and len(p) <= 12 for p in parts):
            d, h, m, s = (int(p) for p in parts)
            return float(((d * 24 + h) * 60 + m) * 60 + s)
    raise ValueError(f"{name}={arguments.shown(value)}{_TIME_FORMS}")


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


def summary_depth(trainer: Any) -> int:
    """How many levels of submodules the fit's model summary shows (0: none): a
    ``ModelSummary`` callback's ``max_depth``, else 1 with ``enable_model_summary``."""
    from torchrig.trainer.lightning_names import ModelSummary

    found = next((c for c in trainer.callbacks if isinstance(c, ModelSummary)), None)
    if found is not None:
        return int(found.max_depth)
    return 1 if trainer.enable_model_summary else 0


def loggers(given: Any, root: Path) -> list[Logger]:
    if given is True:
        return [CSVLogger(root_dir=root)]
    if given is False or given is None:
        return []
    return arguments.instances("logger", given, Logger, "a torchrig Logger, a list of them, True or False")


#: Lightning Trainer arguments torchrig does not take, and what to use instead.
LIGHTNING_ONLY: dict[str, tuple[Any, str]] = {
    "plugins": (
        None,
        "torchrig has no plugin objects: give precision= (a name or a torchrig.Precision), strategy= (a name or "
        "a Strategy object such as DDPStrategy(...)) or accelerator= (a name or a torchrig.Accelerator); the "
        "cluster environment is detected from the launcher",
    ),
    "barebones": (
        False,
        "torchrig's loops cost nothing for features that are off: switch those off one by one with "
        "enable_progress_bar=False, enable_checkpointing=False, logger=False, enable_model_summary=False",
    ),
    "model_registry": (
        None,
        "torchrig uploads nothing: save with a ModelCheckpoint or trainer.save_checkpoint(path) and push "
        "the checkpoint directory to your registry",
    ),
}


def refuse_lightning_only(given: dict[str, Any]) -> None:
    """Refuse the Lightning-only arguments in ``given`` (left at Lightning's default they change
    nothing and pass) and any other unexpected keyword, naming the nearest Trainer argument."""
    from torchrig.trainer.trainer import Trainer

    for name, value in given.items():
        known = LIGHTNING_ONLY.get(name)
        if known is not None:
            default, instead = known
            if value is default or value == default:
                continue
            raise ValueError(
                f"Trainer({name}={arguments.shown(value)}) is a Lightning argument torchrig does not take: {instead}"
            )
        names = [p for p in inspect.signature(Trainer.__init__).parameters if p not in ("self", "lightning_only")]
        near = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}{hint}")


def flag(name: str, value: Any, *, none_ok: bool = False) -> Any:
    """``value`` when it is True or False (or None where ``none_ok``); else a ValueError."""
    if isinstance(value, bool) or (none_ok and value is None):
        return value
    allowed = "True, False or None" if none_ok else "True or False"
    raise ValueError(f"{name}={arguments.shown(value)} must be {allowed}")


def minimums(min_epochs: Any, min_steps: Any, max_epochs: int, max_steps: int) -> tuple[int, int]:
    """``(min_epochs, min_steps)`` as ints (None: 0), checked against the maximums."""
    epochs = 0 if min_epochs is None else arguments.int_in_range("min_epochs", min_epochs, 0)
    steps = 0 if min_steps is None else arguments.int_in_range("min_steps", min_steps, 0)
    if max_epochs != -1 and epochs > max_epochs:
        raise ValueError(f"min_epochs={epochs} is more than max_epochs={max_epochs}; the fit could not reach it")
    if max_steps != -1 and steps > max_steps:
        raise ValueError(f"min_steps={steps} is more than max_steps={max_steps}; the fit could not reach it")
    return epochs, steps
