"""``LambdaCallback``: a callback made of functions, one per event (Lightning's name and arguments)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from torchrig.trainer.callbacks import Callback


def event_names() -> list[str]:
    """The events a Callback can override (its ``on_*`` methods)."""
    return sorted(name for name in dir(Callback) if name.startswith("on_") and callable(getattr(Callback, name)))


class LambdaCallback(Callback):
    """Call the given functions at their events: ``LambdaCallback(on_train_epoch_end=fn)``
    calls ``fn(trainer, module)`` where a Callback's ``on_train_epoch_end`` would be called,
    with the same arguments. Only the events given are called (each costs nothing otherwise).

    Example:
        >>> seen = []
        >>> cb = LambdaCallback(on_train_epoch_end=lambda trainer, module: seen.append(trainer.current_epoch))
    """

    def __init__(self, **events: Callable[..., Any]) -> None:
        known = event_names()
        for name, fn in events.items():
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; the events: {', '.join(known)}"
                raise TypeError(f"LambdaCallback({name}=...) is not a Callback event{hint}")
            if not callable(fn):
                raise TypeError(f"LambdaCallback({name}={fn!r}): give a function")
            setattr(self, name, fn)  # on the instance: the Trainer calls only what a callback overrides
