"""A save's round across ranks: every rank arrives at ``rig.save`` (or is named as absent), and rank
zero's outcome reaches the others through the process group's key-value store, never a collective."""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchrig import arguments
from torchrig.strategies.agreement import default_store

if TYPE_CHECKING:
    from torchrig.checkpoint.remote import CheckpointURL

_RESULT = "torchrig/save/{}/result".format  # rank zero's outcome of save round n: "" or "Type: message"
_arrived = [0]  # rig.save calls every rank arrived at, counted alike on every rank
ARRIVAL_TIMEOUT_ENV = "TORCHRIG_SAVE_ARRIVAL_TIMEOUT"


def arrival_warning_seconds() -> float:
    """How long ``rig.save`` waits for the other ranks before it warns: ``TORCHRIG_SAVE_ARRIVAL_TIMEOUT``
    seconds (60 when unset)."""
    text = os.environ.get(ARRIVAL_TIMEOUT_ENV, "60")
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{ARRIVAL_TIMEOUT_ENV}={text!r} must be a number of seconds, such as 60") from None
    return arguments.finite_at_least(ARRIVAL_TIMEOUT_ENV, seconds)


def all_ranks_arrive(rig: Any, target: Path | CheckpointURL) -> int | None:
    """Say within about a minute when some rank has not called ``rig.save``; fail at the group's timeout.

    Saving is collective (every rank's RNG state is gathered, FSDP ranks write their shards), so
    ``rig.save`` under ``if rig.is_global_zero:`` would wait for the process group's timeout and
    fail without saying why. Each rank marks its arrival in the process group's key-value store
    (not a collective: nothing else can be waiting on it) and waits for the others' marks. After
    ``TORCHRIG_SAVE_ARRIVAL_TIMEOUT`` seconds (60) a warning names the absent ranks; a rank that is
    only late (rank 0 evaluating alone before the save) then still arrives and the save goes on.
    At the process group's timeout the wait ends in a ``RuntimeError`` that says every rank must call it.

    Returns the save's round: the number of saves every rank arrived at before this one (the
    same on every rank; it names the store key of rank zero's outcome, :class:`SharedOutcome`),
    or None without a process group's store.
    """
    warn_after = arrival_warning_seconds()
    store = default_store()
    if store is None:  # no process group
        return None
    n = _arrived[0]
    group_timeout = getattr(getattr(rig, "strategy", None), "timeout", None)
    limit = group_timeout.total_seconds() if isinstance(group_timeout, datetime.timedelta) else 1800.0
    key = "torchrig/save/{}/{}".format
    store.set(key(n, rig.global_rank), target.name)
    keys = [key(n, r) for r in range(rig.world_size)]
    advice = (
        "every rank must call rig.save (rank 0 writes the files, but every rank's state is gathered), so call "
        "it on all ranks, not under `if rig.is_global_zero:`"
    )

    def absent() -> list[int]:
        return [r for r in range(rig.world_size) if not store.check([keys[r]])]

    waited = min(warn_after, limit)
    try:
        store.wait(keys, datetime.timedelta(seconds=waited))
    except (RuntimeError, dist.DistError):
        warnings.warn(
            f"rank {rig.global_rank} has waited {waited:.0f} s in rig.save({str(target)!r}) for rank(s) {absent()}: "
            f"{advice}. Still waiting, up to the process group's timeout ({limit:.0f} s)",
            stacklevel=3,
        )
        try:
            store.wait(keys, datetime.timedelta(seconds=max(limit - waited, 0.001)))
        except (RuntimeError, dist.DistError):
            missing = absent()
            with contextlib.suppress(RuntimeError, dist.DistError):
                store.delete_key(key(n, rig.global_rank))  # not counted: the next save on every rank is round n
            raise RuntimeError(
                f"rig.save({str(target)!r}) was not called on rank(s) {missing} within {limit:.0f} s (the process "
                f"group's timeout) of rank {rig.global_rank}: {advice}"
            ) from None
    _arrived[0] = n + 1
    if n:
        with contextlib.suppress(RuntimeError, dist.DistError):
            store.delete_key(key(n - 1, rig.global_rank))  # every rank is past the previous save's wait
        forget_outcome(rig, n - 1)  # and has learnt its outcome (a save waits for the previous one)
    return n


class SharedOutcome:
    """Rank zero's outcome of save round ``n`` in the process group's key-value store."""

    def __init__(self, store: Any, n: int, timeout: datetime.timedelta) -> None:
        self.store, self.key, self.timeout = store, _RESULT(n), timeout

    def publish(self, message: str) -> None:
        self.store.set(self.key, message)

    def ready(self) -> bool:
        return bool(self.store.check([self.key]))

    def check(self, path: Path | CheckpointURL) -> None:
        self.store.wait([self.key], self.timeout)
        message = self.store.get(self.key).decode()
        if message:
            raise RuntimeError(f"rank 0 failed to save the checkpoint {path}: {message}")


def shared_outcome(rig: Any, n: int | None) -> SharedOutcome | None:
    """How the ranks of ``rig`` share rank zero's outcome of save round ``n`` (None: one process)."""
    if n is None:
        return None
    store = default_store()
    timeout = getattr(rig.strategy, "timeout", None)
    return SharedOutcome(
        store, n, timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(minutes=30)
    )


def forget_outcome(rig: Any, n: int) -> None:
    """Rank zero removes the outcome of round ``n`` once every rank is past it."""
    store = default_store()
    if rig.is_global_zero and store is not None:
        with contextlib.suppress(RuntimeError, dist.DistError):
            store.delete_key(_RESULT(n))
