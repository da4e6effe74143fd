"""Saves that finish in the background: ``rig.save(path, state, blocking=False)``.

Inside the call only a snapshot is taken (every tensor copied to CPU memory, pinned when it lives
on a CUDA device; plain values deep-copied), so training may change the objects right after.
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
import copy
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
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

    def __init__(self, path: Path, *, shared: SharedOutcome | None = None) -> None:
        self.path = path
        self._local: Future[None] = Future()
        self._shared = shared  # how a rank other than zero learns rank zero's outcome
        self._hooks: list[Callable[[Path], None]] = []
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

    def wait(self) -> Path:
        """Wait until the checkpoint is committed and return its directory; raise if the save failed."""
        self._settle()
        if self._outcome is not None:
            self._reported = True
            raise self._outcome
        return self.path

    def on_settle(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the thread that learns the save is over, committed or not."""
        self._closers.append(fn)

    def add_commit_hook(self, hook: Callable[[Path], None]) -> None:
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


# -- the snapshot ------------------------------------------------------------------------------
class HostBuffers:
    """The host memory of a Rig's last snapshot, reused by its next one.

    A fresh allocation costs more than the copy itself (the kernel maps and zeroes every page:
    about 0.5 GB/s here, against several GB/s into memory already mapped), so the buffers stay
    between saves: one extra copy of the saved state lives in host memory from the first
    background save on. Only one save is ever in flight, so the next snapshot never writes into
    buffers a save still reads.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[bool, int], list[torch.UntypedStorage]] = {}
        self._used: list[tuple[bool, torch.UntypedStorage]] = []
        self.dcp_stager: Any = None  # DCP's stager of sharded saves: it keeps its host copies the same way

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        free = self._free.get((pinned, nbytes))
        host = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        self._used.append((pinned, host))
        return host

    def keep_used(self) -> None:
        """The buffers of the snapshot just taken are those the next one reuses (others are freed)."""
        self._free = {}
        for pinned, host in self._used:
            self._free.setdefault((pinned, host.nbytes()), []).append(host)
        self._used = []


class Snapshot:
    """What :func:`to_host` made: ``tree``, the copy; ``ready()``, run first on the background
    thread, finishes it; ``close()``, run on the calling thread once the save is over."""

    def __init__(self, tree: Any, ready: Callable[[], None], close: Callable[[], None]) -> None:
        self.tree, self.ready, self.close = tree, ready, close


def to_host(tree: Any, buffers: HostBuffers | None = None, optimizers: dict[str, Any] | None = None) -> Snapshot:
    """A copy of ``tree`` (dicts, lists, tuples, tensors, plain values) that training cannot change.

    Every tensor is copied to CPU memory (pinned where it comes from CUDA; into ``buffers`` where
    given) with its storage copied once, so tensors that share memory (tied weights, views) still
    share it and are written the same way a direct save writes them. Everything else is deep-copied.

    The state of the torch optimizers in ``optimizers`` (name -> optimizer; Adam's moments: most of
    a checkpoint) is only changed by their ``step``, so it is copied by ``ready()`` on the
    background thread while the next forward and backward run; a step pre-hook makes the next
    ``optimizer.step()`` wait until that copy is done. Each of those tensors' version counter is
    checked after the copy: changed in place meanwhile (not through ``step``), ``ready()`` raises
    instead of writing a mixed state. Copies from a CUDA device are queued on the stream and
    finished by ``ready()``.
    """
    buffers = buffers if buffers is not None else HostBuffers()
    deferred: dict[tuple[str, int, int], str] = {}  # storages of optimizer state -> the optimizer's name
    for name, opt in (optimizers or {}).items():
        for per_param in opt.state.values():
            for t in per_param.values() if isinstance(per_param, dict) else ():
                if isinstance(t, torch.Tensor) and _plain(t):
                    deferred[_key(t.untyped_storage())] = name
    storages: dict[tuple[str, int, int], torch.UntypedStorage] = {}
    later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    memo: dict[int, Any] = {}
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = _host_copy(x, storages, buffers, deferred, later)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    buffers.keep_used()
    devices = {k[0] for k in storages if k[0].startswith("cuda")}
    events = []
    for device in devices:  # what the calling thread queued before (the copies above included)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(torch.device(device)))
        events.append(event)
    copied = threading.Event()

    def wait_for_copy(*_: Any) -> None:
        copied.wait()

    hooks = [opt.register_step_pre_hook(wait_for_copy) for opt in (optimizers or {}).values() if later]

    def ready() -> None:
        changed: list[str] = []
        try:
            for event in events:
                event.synchronize()
            _copy_later(later)
            for device in devices:
                torch.cuda.current_stream(torch.device(device)).synchronize()
            changed = sorted({name for name, src, _, _, version in later if src._version != version})
        finally:
            copied.set()  # before this no optimizer step ran: a changed version is another writer's
        if changed:
            raise RuntimeError(
                f"the state of optimizer {', '.join(map(repr, changed))} was changed in place after "
                "rig.save(..., blocking=False) returned and before the background save had copied it; only "
                "optimizer.step() may change it then (it waits for the copy). Nothing was written"
            )

    def close() -> None:
        for hook in hooks:
            hook.remove()

    return Snapshot(copy.deepcopy(tree, memo), ready, close)


def _copy_later(later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> None:
    """The copies :func:`to_host` left to the background thread."""
    for _, _, src, dst, _ in later:
        dst.copy_(src, non_blocking=src.device.type == "cuda")


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized and not t.requires_grad


def _key(storage: torch.UntypedStorage) -> tuple[str, int, int]:
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


def _host_copy(
    t: torch.Tensor,
    storages: dict[tuple[str, int, int], torch.UntypedStorage],
    buffers: HostBuffers,
    deferred: dict[tuple[str, int, int], str],
    later: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]],
) -> torch.Tensor:
    if not _plain(t) or t.device.type == "meta":
        with torch.no_grad():  # a subclass, a sparse or quantized tensor: torch copies it its own way
            return copy.deepcopy(t) if t.device.type in ("cpu", "meta") else t.to("cpu", copy=True)
    storage = t.untyped_storage()
    key = _key(storage)
    host = storages.get(key)
    if host is None:
        cuda = storage.device.type == "cuda"
        host = buffers.take(storage.nbytes(), pinned=cuda)
        as_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        into = torch.empty(0, dtype=torch.uint8).set_(host)
        if key in deferred:
            later.append((deferred[key], t, as_bytes, into, t._version))
        else:  # a tensor copy runs on torch's threads (Storage.copy_ on one)
            into.copy_(as_bytes, non_blocking=cuda)
        storages[key] = host
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


def host_buffers(rig: Any) -> HostBuffers:
    """The host memory ``rig``'s background saves snapshot into, kept from one save to the next."""
    buffers: HostBuffers | None = getattr(rig, "_host_buffers", None)
    if buffers is None:
        buffers = rig._host_buffers = HostBuffers()
    return buffers


def settle_pending(rig: Any) -> None:
    """Wait for the save ``rig`` runs in the background, if any; raise its error if nobody has yet."""
    pending: SaveHandle | None = getattr(rig, "_pending_save", None)
    if pending is not None:
        rig._pending_save = None
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
