"""Saves that finish in the background: ``rig.save(path, state, blocking=False)``.

Inside the call only a snapshot is taken (every tensor copied to CPU memory, pinned when it lives
on a CUDA device; plain values deep-copied; :mod:`.snapshot`), so training may change the objects right after.
Writing, fsync, SHA-256, ``meta.json``, the atomic rename, the ``last`` link and retention run on
one background thread; the returned :class:`SaveHandle` says when that is done.

Across processes no collective ever runs on the background thread: the ranks learn rank zero's
outcome through the process group's key-value store (whose client serializes its requests), under
a key of the save's round (see :mod:`.rounds`). Sharded saves run
DCP's collectives on a process group of their own (:mod:`.sharded`).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before ours)
import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrig.checkpoint.remote import CheckpointURL
    from torchrig.checkpoint.rounds import SharedOutcome

_unsettled: weakref.WeakSet[SaveHandle] = weakref.WeakSet()


class SaveHandle:
    """A checkpoint that ``rig.save(path, state, blocking=False)`` is writing in the background.

    ``wait()`` returns the checkpoint directory once it is committed on every rank's behalf (rank
    zero writes; the others learn its outcome), or raises what went wrong. The next ``rig.save``
    and ``rig.load`` wait for it themselves and raise its error there if nobody else did.

    Example:
        >>> # handle = rig.save("ckpt/step-000100", {"model": model, "optimizer": opt}, blocking=False)
        >>> # ... keep training ...; handle.wait()  # the Path, once committed
    """

    def __init__(self, path: Path | CheckpointURL, *, shared: SharedOutcome | None = None) -> None:
        self.path = path
        self._local: Future[None] = Future()
        self._shared = shared  # how a rank other than zero learns rank zero's outcome
        self._hooks: list[Callable[[Path | CheckpointURL], None]] = []
        self._outcome: BaseException | None = None
        self._settled = False  # the outcome is known (and the hooks ran if it succeeded)
        self._reported = False  # the error was raised to someone
        self._thread: threading.Thread | None = None
        self._closers: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return f"SaveHandle({str(self.path)!r}, done={self.done()})"

    def done(self) -> bool:
        """Whether the save is over (committed or failed); never waits."""
        if not self._local.done():
            return False
        return self._shared is None or self._shared.ready()

    def wait(self) -> Path | CheckpointURL:
        """Wait until the checkpoint is committed and return its directory; raise if the save failed."""
        self._settle()
        if self._outcome is not None:
            self._reported = True
            raise self._outcome
        return self.path

    def on_settle(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the thread that learns the save is over, committed or not."""
        self._closers.append(fn)

    def add_commit_hook(self, hook: Callable[[Path | CheckpointURL], None]) -> None:
        """Run ``hook(path)`` once the checkpoint is committed, on the thread that waits for it."""
        if self._settled and self._outcome is None:
            hook(self.path)
        else:
            self._hooks.append(hook)

    # -- used by torchrig ------------------------------------------------------------------
    def settle(self) -> None:
        """:meth:`wait`, but an error already raised to someone is not raised again."""
        self._settle()
        if self._outcome is not None and not self._reported:
            self._reported = True
            raise self._outcome

    def _settle(self) -> None:
        if self._settled:
            return
        try:
            self._local.result()
            if self._shared is not None:
                self._shared.check(self.path)
        except BaseException as err:
            self._outcome = err
        self._settled = True
        _unsettled.discard(self)
        closers, self._closers = self._closers, []
        for fn in closers:
            fn()
        if self._outcome is None:
            hooks, self._hooks = self._hooks, []
            for hook in hooks:
                hook(self.path)

    def start(self, job: Callable[[], None] | None, *, background: bool, publish: SharedOutcome | None = None) -> None:
        """Run this rank's part of the save (``None``: nothing to write here) inline or on a thread;
        with ``publish`` (rank zero), its outcome is published to the other ranks."""

        def run() -> None:
            try:
                if job is not None:
                    job()
            except BaseException as err:
                if publish is not None:
                    publish.publish(f"{type(err).__name__}: {err}")
                self._local.set_exception(err)
                return
            if publish is not None:
                publish.publish("")
            self._local.set_result(None)

        if not background or job is None:
            run()
            return
        _unsettled.add(self)
        # Not a daemon: the interpreter waits for a save under way before it exits (:func:`_at_shutdown`).
        self._thread = threading.Thread(target=run, name=f"torchrig-save-{self.path.name}")
        self._thread.start()

    @contextlib.contextmanager
    def starting(self, publish: SharedOutcome | None) -> Iterator[None]:
        """An error while the save is set up on the calling thread is published (by rank zero) too."""
        try:
            yield
        except BaseException as err:
            if publish is not None:
                publish.publish(f"{type(err).__name__}: {err}")
            raise


@dataclass
class BackgroundSaves:
    """What a :class:`~torchrig.Rig` keeps for its background saves (``rig.background_saves``),
    owned by this package: the save under way, the host memory snapshots are copied into (kept
    from one save to the next) and the process group of background sharded saves (made at the
    first one)."""

    pending: SaveHandle | None = None
    host_buffers: Any = None
    group: Any = None


def settle_pending(rig: Any) -> None:
    """Wait for the save ``rig`` runs in the background, if any; raise its error if nobody has yet."""
    saves: BackgroundSaves = rig.background_saves
    pending, saves.pending = saves.pending, None
    if pending is not None:
        pending.settle()


def _at_shutdown() -> None:
    """When the main thread is done, before the interpreter stops its thread pools (which the save
    threads use), let the saves under way finish; then say which failed without anyone waiting
    for it (the error is never lost)."""
    for handle in list(_unsettled):
        thread = handle._thread
        if thread is not None:
            thread.join()
        err = handle._local.exception() if handle._local.done() else None
        if err is not None:
            print(
                f"torchrig: the background save of {handle.path} failed and nothing waited for it "
                f"(call handle.wait() before the end): {type(err).__name__}: {err}",
                file=sys.stderr,
            )


# Run before concurrent.futures' own hook (they run last registered first), which refuses new work.
threading._register_atexit(_at_shutdown)  # type: ignore[attr-defined]
