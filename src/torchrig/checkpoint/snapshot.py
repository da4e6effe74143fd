"""The snapshot a background save writes from: every tensor copied to host memory (reused from one
save to the next), plain values deep-copied, optimizer moments copied on the save's thread while
the next forward and backward run (the next ``optimizer.step()`` waits for that copy)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch


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
    saves = rig.background_saves
    if saves.host_buffers is None:
        saves.host_buffers = HostBuffers()
    buffers: HostBuffers = saves.host_buffers
    return buffers
