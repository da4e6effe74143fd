"""Hangs that explain themselves: which collective every rank was in when one timed out.

Each torchrig collective (``rig.all_reduce``, ``all_gather``, ``broadcast``, ``barrier``,
``reduce_boolean_decision``, and the ones ``rig.save`` makes) notes its name and the caller's
``file:line`` in a ring buffer of the last :data:`KEEP` calls of this process: a few attribute
reads, no communication. When one of them fails with the backend's timeout, this rank writes
what it was doing to the process group's store (a TCPStore, which still answers while a
collective hangs), waits up to the group's timeout for the other ranks to do the same, and
raises :class:`CollectiveTimeoutError` naming, for every rank, the collective it was in. A rank
whose collective fails because a peer's timed out first (gloo then closes the connection) gives
the same report when that peer is writing one.
DDP's own gradient all-reduce is not a torchrig collective and is not recorded.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from torchrig.strategies.agreement import default_store

KEEP = 8
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT = re.compile(r"timed? ?out", re.IGNORECASE)
# A peer whose own collective timed out first drops its connections: this rank then fails with
# this instead of its own timeout, while that peer is writing its report.
_CLOSED = re.compile(r"connection (closed|reset) by peer", re.IGNORECASE)
#: (number of this call, collective, where it was called from), newest last.
recent: deque[tuple[int, str, str]] = deque(maxlen=KEEP)
_count = [0]
_incidents = [0]  # timeouts so far: ranks that time out together are at the same incident


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out; the message says which collective every rank was in."""


def call_site() -> str:
    """``file:line`` of the nearest caller outside torchrig (the user's line)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE) or frame.f_code.co_filename == contextlib.__file__
    ):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def describe(entry: tuple[int, str, str]) -> str:
    number, name, where = entry
    return f"{name} (its collective #{number}) from {where}"


@contextlib.contextmanager
def collective(name: str, rank: int, world_size: int, timeout: timedelta) -> Iterator[None]:
    """Record the collective ``name``; turn the backend's timeout into a report of every rank."""
    _count[0] += 1
    entry = (_count[0], name, call_site())
    recent.append(entry)
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CollectiveTimeoutError):
            raise
        timed_out = _TIMEOUT.search(str(err)) is not None
        if not timed_out and not (_CLOSED.search(str(err)) and _peer_is_reporting(rank, world_size)):
            raise
        raise CollectiveTimeoutError(explain(entry, rank, world_size, timeout, err)) from err


def _peer_is_reporting(rank: int, world_size: int, wait: float = 3.0) -> bool:
    """Whether another rank writes a hang report for the next incident within ``wait`` seconds
    (its collective timed out and closed the connection this one failed on). A peer that crashed
    writes none: the error is then raised as it is, ``wait`` seconds later at most."""
    try:
        store = _incident_store(_incidents[0] + 1)
        deadline = time.monotonic() + wait
        while True:
            if any(store.check([str(r)]) for r in range(world_size) if r != rank):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except Exception:  # no process group or store (the peer that hosted it is gone)
        return False


def _incident_store(incident: int) -> Any:
    """The keys of one incident's reports in the process group's store (one key per rank)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"torchrig/hang/{incident}", default_store())


def explain(entry: tuple[int, str, str], rank: int, world_size: int, timeout: timedelta, err: Exception) -> str:
    """Exchange what every rank is doing through the store; the message naming all of them."""
    states = {rank: describe(entry)}
    try:
        _incidents[0] += 1
        store = _incident_store(_incidents[0])
        store.set(str(rank), states[rank])
        deadline = time.monotonic() + timeout.total_seconds()
        missing = [r for r in range(world_size) if r != rank]
        while missing and time.monotonic() < deadline:
            for r in [r for r in missing if store.check([str(r)])]:
                states[r] = store.get(str(r)).decode()
                missing.remove(r)
            if missing:
                time.sleep(0.1)
    except Exception as store_err:  # the report is a courtesy; the timeout is the error
        states[-1] = f"the other ranks could not be asked ({type(store_err).__name__}: {store_err})"
    lines = [
        f"rank {r} is in {states[r]}"
        if r in states
        else f"rank {r} did not report: it is not in a torchrig "
        "collective (busy, in DDP's gradient all-reduce, or no longer running)"
        for r in range(world_size)
    ]
    if -1 in states:
        lines.append(states[-1])
    earlier = [describe(e) for e in recent if e[0] < entry[0]][-3:]
    before = f"; before it, rank {rank} ran {', '.join(earlier)}" if earlier else ""
    head = (
        f"rank {rank}: a collective timed out after {timeout.total_seconds():g} s "
        "(Rig(timeout=) or the strategy's timeout=) - the ranks are not in the same collective:"
    )
    return f"{head}\n  " + ";\n  ".join(lines) + f"{before}.\nThe backend said: {err}"
