"""``save`` and ``load`` of whole (non-sharded) checkpoints; sharded ones go to :mod:`.sharded`."""

from __future__ import annotations

import contextlib
import copy
import datetime
import errno
import functools
import io
import os
import pickletools
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import nn

from torchrig.checkpoint import background, sharded
from torchrig.checkpoint.background import SaveHandle
from torchrig.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    FileSet,
    VerifiedReader,
    apply_retention,
    commit,
    discard,
    read_meta,
    read_torch_once,
    remove_stale_temps,
    resolve_checkpoint,
    temp_dir_for,
    unsafe_globals,
    update_link,
    write_meta,
    write_torch,
)
from torchrig.checkpoint.state import (
    capture_rng,
    check_key,
    compare_module,
    compare_optimizer,
    extract_tensors,
    for_safetensors,
    is_stateful,
    raise_if,
    read_safetensors,
    read_safetensors_once,
    restore_rng,
    restore_tensors,
    retie,
    shard,
    shard_names,
    split_module_state,
    summary_values,
    unwrap_module,
    write_safetensors,
)

STATE_FILE = "state.pt"
STATE_TENSORS = "state.pt@tensors"  # large tensors of state.pt (optimizer moments); keys cannot hold "@"


def _qualname(obj: Any) -> str:
    from torchrig.wrappers import RigOptimizer

    if isinstance(obj, RigOptimizer):
        obj = obj.optimizer
    t = type(unwrap_module(obj)) if isinstance(obj, nn.Module) else type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def collect(rig: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Everything to write, taken on every rank (state-dict calls may be collectives)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    extras: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    values: dict[str, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    counted: list[nn.Module] = []
    for key, obj in state.items():
        check_key(key)
        if isinstance(obj, nn.Module):
            sd = rig.strategy.module_state_dict(unwrap_module(obj))
            modules[key], extras[key] = split_module_state(sd)
            entries[key] = {"kind": "module", "type": _qualname(obj), "file": f"{key}.safetensors"}
            counted.append(unwrap_module(obj))
        elif is_stateful(obj):
            objects[key] = obj.state_dict()
            entries[key] = {"kind": "state", "type": _qualname(obj)}
        else:
            values[key] = obj
            entries[key] = {"kind": "value", "type": _qualname(obj)}
    rng = capture_rng(rig.device)
    if rig.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks: list[Any] = [None] * rig.world_size
        torch.distributed.all_gather_object(ranks, rng)
        rng_all: list[Any] = ranks
    else:
        rng_all = [rng]
    blob = {"objects": objects, "values": values, "module_extras": extras, "rng": rng_all}
    return {"modules": modules, "blob": blob, "entries": entries, "counts": module_counts(counted)}


def base_meta(rig: Any, entries: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    from torchrig import __version__

    summary = summary_values(values)
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "saved_at_ns": time.time_ns(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "torchrig": __version__,
        "world_size": rig.world_size,
        "device_type": rig.device.type,
        "precision": getattr(rig.precision, "name", None),
        "entries": entries,
        "values": summary,
        "step": summary.get("step", summary.get("global_step")),
        "epoch": summary.get("epoch"),
    }


class _SelfReferenceError(TypeError):
    pass


def _skeleton(obj: Any, where: str, inside: frozenset[int] = frozenset()) -> Any:
    """``obj`` with every tensor replaced by an empty one: enough to see which classes it pickles.

    A list or dict that contains itself is a :class:`TypeError` naming where (pickle would recurse).
    """
    if isinstance(obj, torch.Tensor):  # a quantized tensor cannot be made empty without its quantizer: kept
        return obj if obj.is_quantized else torch.empty(0, dtype=obj.dtype)
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in inside:
            raise _SelfReferenceError(
                f"{where} is a {type(obj).__name__} that contains itself; a checkpoint cannot hold a list or "
                "dict that refers to itself"
            )
        inside = inside | {id(obj)}
    if isinstance(obj, dict):
        out = {k: _skeleton(v, f"{where}[{k!r}]", inside) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        same = copy.copy(obj)  # a dict subclass (OrderedDict, defaultdict) keeps its class for the check
        same.clear()
        same.update(out)
        return same
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_skeleton(v, f"{where}[{i}]", inside) for i, v in enumerate(obj))
    return obj


_OPCODES_IN_WORDS = {"LONG4": "an int of more than 255 bytes (pickle opcode LONG4)"}


def _why_not_saved(err: BaseException) -> str:
    """What a failed save-and-reload of one value says, in words."""
    if isinstance(err, RecursionError):
        return "it nests too deeply for pickle"
    found = re.search(r"Unsupported operand (\d+)", str(err))
    op = next((o.name for o in pickletools.opcodes if found and o.code == chr(int(found[1]))), None)
    if op is not None:
        what = _OPCODES_IN_WORDS.get(op, f"the pickle opcode {op}")
        return f"weights_only loading cannot read {what} back"
    if "Can't pickle" in str(err):  # a lambda, a local class: PicklingError or AttributeError
        return f"pickle cannot store it ({err}); functions and local classes cannot be saved"
    return f"{type(err).__name__}: {err}"


def check_weights_only(blob: dict[str, Any]) -> None:
    """Refuse, at save time and before any file is written, state that ``weights_only`` loading
    could not read back: a :class:`TypeError` naming the key (``state['step']``) and why."""
    parts = [(f"state[{k!r}]", v) for k, v in blob["values"].items()]
    parts += [(f"state[{k!r}].state_dict()", v) for k, v in blob["objects"].items()]
    parts += [(f"the extra state of state[{k!r}]", v) for k, v in blob["module_extras"].items() if v]
    for where, value in parts:
        buf = io.BytesIO()
        try:
            torch.save(_skeleton(value, where), buf)
            buf.seek(0)
            bad = unsafe_globals(buf)
        except _SelfReferenceError as err:
            raise TypeError(str(err)) from None
        except Exception as err:  # pickling, torch's serializer, the weights_only reader
            raise TypeError(f"{where} cannot be saved in a checkpoint: {_why_not_saved(err)}") from None
        if bad:
            raise TypeError(
                f"{where} holds Python objects that cannot be loaded safely: {', '.join(bad)}. "
                "A checkpoint stores tensors, numbers, strings, lists, tuples and dicts only (loading never "
                "unpickles arbitrary objects); convert these values to plain types, or give the object "
                "state_dict()/load_state_dict() that return plain types"
            )


def _add_tensor_files(files: FileSet, prefix: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Queue ``tensors`` as one or more safetensors files (tied ones stored once); their names."""
    out, metadata = for_safetensors(tensors)
    groups = shard(out)
    names = shard_names(prefix, len(groups))
    for name, group in zip(names, groups, strict=True):
        files.add(name, functools.partial(write_safetensors, tensors=group, metadata=metadata))
    return names


def module_counts(modules: Iterable[nn.Module]) -> dict[str, int]:
    """``{"parameters": n, "buffers": m}``: the elements of the modules' ``nn.Parameter`` objects
    (trainable and frozen; a shared or tied one counts once; a sharded one by its full size) and,
    apart, of the buffers a state dict saves (BatchNorm's running statistics and counters).
    What ``meta.json`` records and ``torchrig checkpoint inspect`` shows.

    Example:
        >>> module_counts([nn.BatchNorm1d(4)])
        {'parameters': 8, 'buffers': 9}
    """
    params: dict[int, int] = {}
    buffers: dict[int, int] = {}
    for module in modules:
        params.update((id(p), p.numel()) for p in module.parameters())
        for sub in module.modules():
            saved = (b for name, b in sub._buffers.items() if name not in sub._non_persistent_buffers_set)
            buffers.update((id(b), b.numel()) for b in saved if b is not None)
    return {"parameters": sum(params.values()), "buffers": sum(buffers.values())}


def read_tensor_files(
    reader: VerifiedReader, names: list[str], jobs: dict[str, Future[Any]] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors files ``names`` (one entry, maybe several shards), on CPU.

    ``jobs`` holds reads :func:`start_tensor_reads` started (verified when they finish); other
    files are mapped, and :meth:`VerifiedReader.check` must pass before they are used.
    """
    merged: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name in names:
        job = (jobs or {}).get(name)
        tensors, meta = job.result() if job is not None else reader.read(name, read_safetensors)
        merged.update(tensors)
        metadata.update(meta)
    try:
        return retie(merged, metadata)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"the tied-tensor list of {names} names a missing tensor ({err}); damaged") from err


def start_tensor_reads(reader: VerifiedReader, meta: dict[str, Any]) -> dict[str, Future[Any]]:
    """Start reading and hashing every safetensors file at once, on the reader's threads.

    Module weights are mapped from the page cache and hashed there: ``load_state_dict`` copies
    them into the parameters after every checksum matched (measured: reading them into memory
    first costs more than twice as much). The tensors of ``state.pt`` (optimizer moments) are
    kept by their objects, so they are read once into their own memory and hashed there: what
    was verified is what is kept, and nothing stays mapped from the file.
    """
    jobs = {}
    for name in meta["files"]:
        if name.startswith(STATE_TENSORS):
            jobs[name] = reader.submit(name, read_safetensors_once)
        elif name.endswith(".safetensors"):
            reader.path(name)  # its hash starts now
    return jobs


def module_files(entry: dict[str, Any]) -> list[str]:
    """The safetensors files of a module entry (format 1 had one, ``file``)."""
    return list(entry["files"] if "files" in entry else [entry["file"]])


def _no_space(err: BaseException | None) -> bool:
    """Whether ``err`` or an error it was raised from is a full disk (or quota): torch reports one as
    ``unexpected pos`` with the ``OSError`` as its context, safetensors as ``(os error 28)``."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if f"(os error {errno.ENOSPC})" in str(err) or f"(os error {errno.EDQUOT})" in str(err):
            return True
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
        causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
        if any(isinstance(c, BaseException) and _no_space(c) for c in causes):
            return True
        err = err.__cause__ or err.__context__
    return False


def raise_no_space(err: BaseException, target: Path, needed: int) -> None:
    """A :class:`CheckpointError` saying how much room the checkpoint needs, if ``err`` is a full disk."""
    if not _no_space(err):
        return
    try:
        free = f"{shutil.disk_usage(target.parent).free / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    raise CheckpointError(
        f"no space left on device at {target}: the checkpoint needs about {needed / 1e6:.1f} MB, {free}; "
        "nothing was replaced (the previous checkpoint and the link are as they were)"
    ) from err


def _payload_bytes(payload: dict[str, Any]) -> int:
    """About the size of a checkpoint: the bytes of its tensors, each storage once."""
    seen: dict[tuple[int, int], int] = {}
    stack: list[Any] = [payload["modules"], payload["blob"]]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            seen[(x.untyped_storage().data_ptr(), x.nbytes)] = x.nbytes
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sum(seen.values()) + (64 << 10)  # and the pickle, the headers and meta.json


def write(rig: Any, target: Path, payload: dict[str, Any], *, keep_last: int | None, link: str | None) -> None:
    """Rank zero: write every file into a temp dir, fsync, then rename it into place (``payload``
    passed :func:`check_weights_only`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent)
    tmp = temp_dir_for(target)
    try:
        with FileSet(tmp) as files:
            blob, external, where = extract_tensors(payload["blob"])
            names = _add_tensor_files(files, STATE_TENSORS, external) if external else []
            blob["external"] = {"files": names, "where": where}
            files.add(STATE_FILE, functools.partial(write_torch, obj=blob))
            for key, sd in payload["modules"].items():
                entry = payload["entries"][key]
                entry["files"] = _add_tensor_files(files, key, sd)
                if len(entry["files"]) > 1:
                    del entry["file"]  # format 1 readers would see only the first shard
            table = files.finish()
        tensors = sum(len(sd) for sd in payload["modules"].values())
        meta = base_meta(rig, payload["entries"], payload["blob"]["values"])
        meta.update(sharded=False, files=table, tensors=tensors, **payload["counts"])
        write_meta(tmp, meta)
        commit(tmp, target)
    except BaseException as err:
        discard(tmp)
        raise_no_space(err, target, _payload_bytes(payload))
        raise
    if link:
        update_link(target, link)
    if keep_last is not None:
        apply_retention(target, keep_last)


_arrived = [0]  # rig.save calls every rank arrived at, counted alike on every rank
ARRIVAL_TIMEOUT_ENV = "TORCHRIG_SAVE_ARRIVAL_TIMEOUT"


def all_ranks_arrive(rig: Any, target: Path) -> int | None:
    """Say within about a minute when some rank has not called ``rig.save``; fail at the group's timeout.

    Saving is collective (every rank's RNG state is gathered, FSDP ranks write their shards), so
    ``rig.save`` under ``if rig.is_global_zero:`` would wait for the process group's timeout and
    fail without saying why. Each rank marks its arrival in the process group's key-value store
    (not a collective: nothing else can be waiting on it) and waits for the others' marks. After
    ``TORCHRIG_SAVE_ARRIVAL_TIMEOUT`` seconds (60) a warning names the absent ranks; a rank that is
    only late (rank 0 evaluating alone before the save) then still arrives and the save goes on.
    At the process group's timeout the wait ends in a ``RuntimeError`` that says every rank must call it.

    Returns the save's round: the number of saves every rank arrived at before this one (the
    same on every rank; it names the store key of rank zero's outcome, see :mod:`.background`),
    or None without a process group's store.
    """
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no default group, or a torch without the store
        return None
    n = _arrived[0]
    warn_after = float(os.environ.get(ARRIVAL_TIMEOUT_ENV, "60"))
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
        background.forget_outcome(rig, n - 1)  # and has learnt its outcome (a save waits for the previous one)
    return n


@overload
def save(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    keep_last: int | None = ...,
    link: str | None = ...,
    blocking: Literal[True] = ...,
) -> Path: ...


@overload
def save(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    keep_last: int | None = ...,
    link: str | None = ...,
    blocking: Literal[False],
) -> SaveHandle: ...


@overload
def save(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    keep_last: int | None = ...,
    link: str | None = ...,
    blocking: bool,
) -> Path | SaveHandle: ...


def save(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    keep_last: int | None = None,
    link: str | None = "last",
    blocking: bool = True,
) -> Path | SaveHandle:
    """Save ``state`` atomically as the checkpoint directory ``path``; see :mod:`torchrig.checkpoint`.

    Every rank calls it; rank zero writes (under FSDP every rank writes its shards) and the
    others wait for it, and an error on rank zero is raised on every rank. A save still running
    in the background (``blocking=False``) is waited for first, and its error raised here.

    Args:
        rig: the :class:`~torchrig.Rig` of the run.
        path: the checkpoint directory to create (or replace).
        state: names to modules, optimizers, schedulers, prepared dataloaders, the precision or
            a GradScaler (anything with ``state_dict``/``load_state_dict``), and plain values.
        keep_last: keep only the newest ``keep_last`` checkpoints next to ``path``.
        link: the symlink next to ``path`` pointed at it (``None``: no link).
        blocking: ``False`` takes a snapshot of ``state`` in host memory and returns at once; the
            files are written, checked and committed on a background thread (see
            :class:`~torchrig.checkpoint.SaveHandle`).

    Returns:
        The checkpoint directory, or with ``blocking=False`` a :class:`SaveHandle` whose ``wait()``
        returns it once committed.

    Example:
        >>> # rig.save(f"ckpt/step-{step:06d}", {"model": model, "opt": opt, "step": step}, keep_last=3)
    """
    if not isinstance(state, dict):
        raise TypeError(f"save() takes state as a dict such as {{'model': model, 'step': 3}}, got {type(state)}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive int (or None to keep every checkpoint)")
    if not isinstance(blocking, bool):
        raise TypeError(f"save(blocking={blocking!r}) must be True or False")
    target = Path(path).absolute()
    if link is not None and target.name == link:
        raise ValueError(
            f"cannot save to {target}: {link!r} is the link torchrig points at the newest checkpoint; "
            "save to a named directory such as 'step-000100'"
        )
    for key in state:
        check_key(key)
    settle_pending(rig)
    n = all_ranks_arrive(rig, target) if rig.world_size > 1 else None
    shared = background.shared_outcome(rig, n)
    handle = background.SaveHandle(target, shared=None if rig.is_global_zero else shared)
    publish = shared if rig.is_global_zero else None
    job: Callable[[], None] | None
    with handle.starting(publish):
        if rig.strategy.sharded:
            job = sharded.start(rig, target, state, keep_last=keep_last, link=link, blocking=blocking)
        else:
            job = _start_whole(rig, target, state, handle, keep_last=keep_last, link=link, blocking=blocking)
    handle.start(job, background=not blocking, publish=publish)
    if blocking:
        return handle.wait()
    rig._pending_save = handle
    return handle


def _start_whole(
    rig: Any,
    target: Path,
    state: dict[str, Any],
    handle: SaveHandle,
    *,
    keep_last: int | None,
    link: str | None,
    blocking: bool,
) -> Callable[[], None] | None:
    """Gather a whole checkpoint's state on every rank; rank zero's job writes it (others have none)."""
    payload = collect(rig, state)
    if not rig.is_global_zero:
        return None
    check_weights_only(payload["blob"])  # fails before any file is touched
    ready: Callable[[], None] | None = None
    if not blocking:
        optimizers = {k: getattr(o, "optimizer", o) for k, o in state.items() if isinstance(o, torch.optim.Optimizer)}
        snapshot = background.to_host(payload, host_buffers(rig), optimizers)
        payload, ready = snapshot.tree, snapshot.ready
        handle.on_settle(snapshot.close)

    def job() -> None:
        if ready is not None:
            ready()
        write(rig, target, payload, keep_last=keep_last, link=link)

    return job


def host_buffers(rig: Any) -> background.HostBuffers:
    """The host memory ``rig``'s background saves snapshot into, kept from one save to the next."""
    buffers: background.HostBuffers | None = getattr(rig, "_host_buffers", None)
    if buffers is None:
        buffers = rig._host_buffers = background.HostBuffers()
    return buffers


def settle_pending(rig: Any) -> None:
    """Wait for the save ``rig`` runs in the background, if any; raise its error if nobody has yet."""
    pending: SaveHandle | None = getattr(rig, "_pending_save", None)
    if pending is not None:
        rig._pending_save = None
        pending.settle()


def load(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any] | None = None,
    strict: bool = True,
    *,
    map_location: torch.device | str | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into the objects of ``state`` in place; returns what is left over.

    Every file is checked against its SHA-256 before anything is changed; RNG states are
    restored when ``state`` is given (so training continues exactly), not when only reading.
    A save running in the background is waited for first (its error is raised here).

    Args:
        rig: the :class:`~torchrig.Rig` of the run.
        path: a checkpoint directory, or the ``last`` link.
        state: the objects to fill (``None``: fill nothing, return everything).
        strict: every key of ``state`` must be in the checkpoint and every module must match
            exactly; with ``False`` what matches is loaded and the rest skipped.
        map_location: the device for returned tensors (default ``rig.device``).
        verify: check SHA-256 checksums (a size check is always made).

    Returns:
        Plain values (step, epoch, metrics) and entries not named in ``state``. Plain values
        named in ``state`` are also updated there.

    Example:
        >>> # left = rig.load("ckpt/last", {"model": model, "optimizer": opt}); step = left["step"]
    """
    settle_pending(rig)  # a save running in the background first (it may be the one loaded)
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    if state is not None and not isinstance(state, dict):
        raise TypeError(f"load() takes state as a dict of the objects to fill, got {type(state)}")
    device = torch.device(map_location) if map_location is not None else rig.device
    if meta.get("sharded"):
        return _update_values(state, sharded.load(rig, folder, meta, state, strict=strict, verify=verify))
    entries: dict[str, dict[str, Any]] = meta["entries"]
    wanted = state if state is not None else {}
    missing = [k for k in wanted if k not in entries]
    if missing and strict:
        raise CheckpointError(
            f"the checkpoint {folder} has no entries {missing}; it has {sorted(entries)} "
            "(pass strict=False to load only what is there)"
        )
    blob, tensors = read_whole(folder, meta, device, verify=verify)
    return _update_values(state, _apply(rig, folder, entries, blob, tensors, state, strict=strict, device=device))


def read_whole(
    folder: Path, meta: dict[str, Any], device: torch.device, *, verify: bool = True, modules: bool = True
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``state.pt`` (its large tensors put back) and, with ``modules``, each module entry's
    tensors, of a checkpoint that is not sharded; every file checked before anything is returned."""
    entries: dict[str, dict[str, Any]] = meta["entries"]
    with VerifiedReader(folder, meta, verify=verify) as reader:
        for name in meta["files"]:
            reader.path(name)  # every file's hash starts now, on a pool of threads
        blob = reader.submit(STATE_FILE, functools.partial(read_torch_once, map_location=device)).result()
        external = blob.pop("external", None) or {"files": [], "where": []}
        extracted = read_tensor_files(reader, external["files"])
        tensors = {
            key: read_tensor_files(reader, module_files(e))
            for key, e in entries.items()
            if e["kind"] == "module" and modules
        }
        reader.check()  # nothing is touched unless every file is intact
    try:
        restore_tensors(blob, external["where"], extracted, device)
    except (KeyError, IndexError, TypeError) as err:
        raise CheckpointError(
            f"{folder / STATE_FILE} does not match its tensor files ({err!r}); the checkpoint is damaged"
        ) from err
    return blob, tensors


def _update_values(state: dict[str, Any] | None, left: dict[str, Any]) -> dict[str, Any]:
    """Plain values named in ``state`` take their loaded value there (whole and sharded loads alike)."""
    for key, obj in (state or {}).items():
        if key in left and not is_stateful(obj):
            state[key] = left[key]  # type: ignore[index]  # state is not None here
    return left


def _apply(
    rig: Any,
    folder: Path,
    entries: dict[str, dict[str, Any]],
    blob: dict[str, Any],
    tensors: dict[str, dict[str, torch.Tensor]],
    state: dict[str, Any] | None,
    *,
    strict: bool,
    device: torch.device,
) -> dict[str, Any]:
    wanted = state if state is not None else {}
    modules = {k: o for k, o in wanted.items() if isinstance(o, nn.Module) and k in entries}
    objects = {k: o for k, o in wanted.items() if k not in modules and k in entries and is_stateful(o)}
    raise_if(check_load(entries, blob, tensors, modules, objects, strict=strict))
    # Every entry matched: now change the objects. Those with state_dict first, each restored if a
    # later one fails (torch's own load_state_dict checks less than check_load and can still fail);
    # module weights last, their names and shapes checked above.
    done: list[tuple[Any, Any]] = []
    rng_before = capture_rng(rig.device) if state is not None else None
    try:
        if state is not None:
            rngs = blob["rng"]
            restore_rng(rngs[rig.global_rank] if len(rngs) == rig.world_size else rngs[0], rig.device)
        for key, obj in objects.items():
            done.append((obj, snapshot(obj)))
            try:
                obj.load_state_dict(blob["objects"].pop(key))
            except (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError) as err:
                raise CheckpointError(
                    f"could not load checkpoint entry {key!r} (saved from a {entries[key]['type']}) into "
                    f"the {type(obj).__name__} given: {err}; nothing was changed"
                ) from err
        for key, obj in modules.items():
            sd = {**tensors.pop(key), **blob["module_extras"].get(key, {})}
            unwrap_module(obj).load_state_dict(sd, strict=strict)
    except BaseException:
        for obj, before in reversed(done):
            obj.load_state_dict(before)
        if rng_before is not None:
            restore_rng(rng_before, rig.device)
        raise
    left: dict[str, Any] = dict(blob["values"])
    left.update(blob["objects"])
    copies: dict[int, torch.Tensor] = {}  # module weights are mapped from the file: copy them, ties kept
    left.update(
        {
            k: {n: copies.setdefault(id(t), t.to(device, copy=True)) for n, t in sd.items()}
            for k, sd in tensors.items()
            if k not in modules
        }
    )
    return left


def check_load(
    entries: dict[str, dict[str, Any]],
    blob: dict[str, Any],
    tensors: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, nn.Module],
    objects: dict[str, Any],
    *,
    strict: bool,
) -> str | None:
    """Everything that would make loading into ``modules`` and ``objects`` fail, before any changes.

    Modules: entry kind, names and shapes (with ``strict=False`` mismatched tensors are dropped
    from ``tensors``). Objects with ``state_dict``: a saved state to load; optimizers and LR
    schedulers: the class they were saved from; optimizers: parameter groups and state shapes.
    """
    problems = []
    for key, obj in modules.items():
        if entries[key]["kind"] != "module":
            problems.append(f"checkpoint entry {key!r} holds a {entries[key]['type']}, not a module's weights")
            continue
        if key not in tensors:  # a sharded checkpoint: DCP compares its modules itself
            continue
        wrong, message = compare_module(key, unwrap_module(obj), tensors[key])
        if message is not None and strict:
            problems.append(message)
        for name in wrong:
            tensors[key].pop(name)
    for key, obj in objects.items():
        if key not in blob["objects"]:
            problems.append(f"checkpoint entry {key!r} holds a {entries[key]['type']}, which has no state_dict")
            continue
        if isinstance(obj, torch.optim.Optimizer):
            message = compare_optimizer(key, entries[key]["type"], obj, _qualname(obj), blob["objects"][key])
            if message is not None:
                problems.append(message)
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and _qualname(obj) != entries[key]["type"]:
            problems.append(
                f"checkpoint entry {key!r} was saved from a {entries[key]['type']}, not the {_qualname(obj)} given"
            )
    return "\n".join(problems) if problems else None


def snapshot(obj: Any) -> Any:
    """``obj.state_dict()`` to restore it with ``load_state_dict``: a deep copy, tensors shared
    (a load replaces the tensors an object holds, it does not write into them)."""
    sd = obj.state_dict()
    memo: dict[int, Any] = {}
    stack = [sd]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            memo[id(x)] = x
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return copy.deepcopy(sd, memo)
