"""Whether every rank reaches the same point within a time limit, asked without a collective.

A collective waits for every rank; a rank that never comes (it is stuck in another collective,
or it is not failing at all) makes it wait until the process group's timeout, then fail. Some
decisions must not wait like that: "did every rank raise here, so that they can save together?"
This asks through the process group's store (a TCPStore, which answers while the ranks are busy):
each rank that arrives counts itself, and the first rank to see either every rank counted or its
time limit pass writes the decision (``compare_set``: the first writer wins). Every rank that asks
reads that one decision, so either every rank goes on to the collective work, or none does (a rank
arriving after a "not every rank" decision reads it too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

#: Seconds between two looks at the count while waiting for the other ranks.
POLL_INTERVAL = 0.05


@dataclass(frozen=True)
class Arrival:
    """The decision for one point: ``everyone`` is True when all ``world_size`` ranks reached it in
    time; ``arrived`` is how many had when this rank last looked; ``error`` says why the store could
    not be asked (then ``everyone`` is False)."""

    everyone: bool
    arrived: int
    world_size: int
    error: str | None = None


def every_rank_arrives(store: Any, world_size: int, key: str, timeout: float) -> Arrival:
    """Count this rank in at ``key`` and wait (at most ``timeout`` seconds) for the decision.

    ``store`` is a ``torch.distributed.Store`` shared by the ranks (None with one process, where the
    answer is yes at once). Each rank must call it at most once per ``key``.
    """
    if world_size == 1 or store is None:
        return Arrival(everyone=True, arrived=1, world_size=1)
    prefix = f"torchrig/arrive/{key}/"
    arrived = 0
    try:
        arrived = store.add(prefix + "count", 1)
        deadline = time.monotonic() + timeout
        while True:
            if arrived >= world_size:
                decision = store.compare_set(prefix + "decision", "", "all")
            elif time.monotonic() >= deadline:
                decision = store.compare_set(prefix + "decision", "", "some")
            elif store.check([prefix + "decision"]):
                decision = store.get(prefix + "decision")
            else:
                time.sleep(POLL_INTERVAL)
                arrived = store.add(prefix + "count", 0)
                continue
            return Arrival(everyone=decision == b"all", arrived=arrived, world_size=world_size)
    except Exception as err:  # the store's host may be gone with its process
        return Arrival(everyone=False, arrived=arrived, world_size=world_size, error=f"{type(err).__name__}: {err}")


def default_store() -> Any:
    """The default process group's store, or None without a process group. torch has no public
    call for it (``_get_default_store`` is private): every use in torchrig goes through here."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()
