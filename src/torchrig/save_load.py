"""``rig.save`` and ``rig.load``: the Rig's side of a checkpoint. The files, their format and their
safety are :mod:`torchrig.checkpoint`; here a save also records progress for the strategy (the
crash-loop check of torchrun restarts), at once or when a background save commits.

:class:`SaveLoad` is a base class of :class:`~torchrig.Rig` (``rig.py``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from torchrig import checkpoint
from torchrig.checkpoint.background import SaveHandle

if TYPE_CHECKING:
    from torchrig.checkpoint.remote import CheckpointURL
    from torchrig.strategies import Strategy


class SaveLoad:
    """``save`` and ``load`` of :class:`~torchrig.Rig`."""

    if TYPE_CHECKING:  # what the Rig holds (rig.py)
        backwards_unstepped: int

        @property
        def strategy(self) -> Strategy: ...

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = ...,
        link: str | None = ...,
        blocking: Literal[True] = ...,
    ) -> Path | CheckpointURL: ...

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = ...,
        link: str | None = ...,
        blocking: Literal[False],
    ) -> SaveHandle: ...

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = ...,
        link: str | None = ...,
        blocking: bool,
    ) -> Path | CheckpointURL | SaveHandle: ...

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        keep_last: int | None = None,
        link: str | None = "last",
        blocking: bool = True,
    ) -> Path | CheckpointURL | SaveHandle:
        """Save ``state`` atomically to the checkpoint directory ``path`` (see :mod:`torchrig.checkpoint`).

        ``blocking=False`` returns a :class:`~torchrig.checkpoint.SaveHandle` once a snapshot is
        taken; the files are written in the background (docs/checkpoints.md, "Async saves").
        """
        unstepped = self.backwards_unstepped
        if unstepped:
            warnings.warn(
                f"rig.save(): {unstepped} backward pass{'es' if unstepped != 1 else ''} ran since a prepared optimizer "
                "last stepped; a checkpoint holds the weights and the optimizer's state, not the gradients accumulated "
                "since, so a run resumed from it loses them and its weights differ from the run never stopped. Save "
                "right after optimizer.step() (at the end of an accumulation window)",
                stacklevel=2,
            )
        saved = checkpoint.save(self, path, state, keep_last=keep_last, link=link, blocking=blocking)
        if not isinstance(saved, SaveHandle):
            self.strategy.record_progress()  # for the crash-loop check of torchrun restarts
        else:
            saved.add_commit_hook(lambda _: self.strategy.record_progress())
        return saved

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        prepare: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint into the objects of ``state`` in place; returns what is left over.
        ``prepare(values)`` runs once the files are checked, before any object is compared or
        loaded (see :func:`torchrig.checkpoint.load`)."""
        return checkpoint.load(self, path, state, strict=strict, prepare=prepare)
