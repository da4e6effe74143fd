"""``save`` and ``load``, and the whole (not sharded) format: rank zero writes every file; sharded
checkpoints go to :mod:`.sharded`. Both formats share the lower modules (:mod:`.entries`,
:mod:`.tensors`, :mod:`.restore`, :mod:`.files`, :mod:`.reading`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

import torch

from torchrig import arguments
from torchrig.checkpoint import remote, sharded
from torchrig.checkpoint.background import SaveHandle, settle_pending
from torchrig.checkpoint.entries import base_meta, check_entries, check_key, collect
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.failures import uncommitted
from torchrig.checkpoint.files import (
    FileSet,
    discard,
    folder_identity,
    prepare_target,
    publish,
    write_torch,
)
from torchrig.checkpoint.meta import STATE_FILE, STATE_TENSORS
from torchrig.checkpoint.reading import VerifiedReader, read_meta, read_torch_once
from torchrig.checkpoint.remote import CheckpointURL
from torchrig.checkpoint.restore import apply_loaded, update_values
from torchrig.checkpoint.rounds import all_ranks_arrive, shared_outcome
from torchrig.checkpoint.snapshot import host_buffers, to_host
from torchrig.checkpoint.storable import check_weights_only
from torchrig.checkpoint.targets import check_target
from torchrig.checkpoint.tensors import (
    add_tensor_files,
    extract_tensors,
    module_files,
    payload_bytes,
    read_tensor_files,
    restore_tensors,
)


def write(
    rig: Any, target: Path | CheckpointURL, payload: dict[str, Any], *, keep_last: int | None, link: str | None
) -> None:
    """Rank zero: write every file into a temp dir, fsync, then rename it into place (``payload``
    passed :func:`check_weights_only`); on object storage, upload it by :func:`remote.commit`'s rule."""
    if isinstance(target, CheckpointURL):
        with (
            remote.staging() as staged,
            remote.Upload(target, link) as upload,
            uncommitted(target, lambda: payload_bytes(payload), staged=staged),  # a failure after the commit says so
        ):
            meta = fill(rig, staged, payload, fsync=False, written=upload.send)  # each file uploaded once written
            upload.commit(staged, meta, keep_last=keep_last)
        return
    with uncommitted(target, lambda: payload_bytes(payload)):
        tmp = prepare_target(target, link)
        try:
            publish(tmp, target, fill(rig, tmp, payload), link=link, keep_last=keep_last)
        except BaseException:
            discard(tmp)  # gone already once committed
            raise


def fill(
    rig: Any,
    tmp: Path,
    payload: dict[str, Any],
    *,
    fsync: bool = True,
    written: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Write every file of a whole checkpoint into the folder ``tmp`` (each fsynced with ``fsync``,
    ``written(path)`` called once each is written); its ``meta.json`` content, which the commit
    writes last."""
    with FileSet(tmp, fsync=fsync, written=written) as files:
        blob, external, where = extract_tensors(payload["blob"])
        names = add_tensor_files(files, STATE_TENSORS, external) if external else []
        blob["external"] = {"files": names, "where": where}
        files.add(STATE_FILE, functools.partial(write_torch, obj=blob))
        for key, sd in payload["modules"].items():
            entry = payload["entries"][key]
            entry["files"] = add_tensor_files(files, key, sd)
            if len(entry["files"]) > 1:
                del entry["file"]  # format 1 readers would see only the first shard
        table = files.finish()
    tensors = sum(len(sd) for sd in payload["modules"].values())
    meta = base_meta(rig, payload["entries"], payload["blob"]["values"])
    meta.update(sharded=False, files=table, tensors=tensors, **payload["counts"])
    return meta


@overload
def save(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    keep_last: int | None = ...,
    link: str | None = ...,
    blocking: Literal[True] = ...,
) -> Path | CheckpointURL: ...


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
) -> Path | CheckpointURL | SaveHandle: ...


def save(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    keep_last: int | None = None,
    link: str | None = "last",
    blocking: bool = True,
) -> Path | CheckpointURL | SaveHandle:
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
    if keep_last is not None:
        arguments.int_in_range("keep_last", keep_last, 1, hint="; pass None to keep every checkpoint")
    if not isinstance(blocking, bool):
        raise TypeError(f"save(blocking={blocking!r}) must be True or False")
    arguments.path("path", path)
    target: Path | CheckpointURL = remote.as_url(path) or Path(remote.local_path(path)).absolute()
    if link is not None and target.name == link:
        raise ValueError(
            f"cannot save to {target}: {link!r} is the link torchrig points at the newest checkpoint; "
            "save to a named directory such as 'step-000100'"
        )
    for key in state:
        check_key(key)
    settle_pending(rig)
    n = all_ranks_arrive(rig, target) if rig.world_size > 1 else None
    shared = shared_outcome(rig, n)
    handle = SaveHandle(target, shared=None if rig.is_global_zero else shared)
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
    rig.background_saves.pending = handle
    return handle


def _start_whole(
    rig: Any,
    target: Path | CheckpointURL,
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
    if isinstance(target, CheckpointURL):  # here too, so a background save is refused at once
        remote.check_target(target, link)
    else:
        check_target(target, link)
    ready: Callable[[], None] | None = None
    if not blocking:
        optimizers = {k: getattr(o, "optimizer", o) for k, o in state.items() if isinstance(o, torch.optim.Optimizer)}
        snapshot = to_host(payload, host_buffers(rig), optimizers)
        payload, ready = snapshot.tree, snapshot.ready
        handle.on_settle(snapshot.close)

    def job() -> None:
        if ready is not None:
            ready()
        write(rig, target, payload, keep_last=keep_last, link=link)

    return job


def load(
    rig: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any] | None = None,
    strict: bool = True,
    *,
    map_location: torch.device | str | None = None,
    verify: bool = True,
    prepare: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into the objects of ``state`` in place; returns what is left over.

    Every file read is checked against its SHA-256 before anything is changed (of a sharded
    checkpoint, the shards each rank's read plan names: from object storage, only these are
    fetched); RNG states are restored when ``state`` is given (so training continues exactly),
    not when only reading.
    A save running in the background is waited for first (its error is raised here).

    Args:
        rig: the :class:`~torchrig.Rig` of the run.
        path: a checkpoint directory, or the ``last`` link.
        state: the objects to fill (``None``: fill nothing, return everything).
        strict: every key of ``state`` must be in the checkpoint and every module must match
            exactly; with ``False`` what matches is loaded and the rest skipped.
        map_location: the device for returned tensors (default ``rig.device``).
        verify: check SHA-256 checksums (a size check is always made).
        prepare: called as ``prepare(values)`` with the checkpoint's plain values once every file
            is read and checked (of a sharded one, ``state.pt`` and ``.metadata``), before any
            entry of ``state`` is compared or loaded: it makes the objects of ``state`` like the
            saved ones where the saved run changed them (parameter groups added to an optimizer, a
            scheduler swapped in), and may add entries to ``state``. What it changes is its own: a
            load refused after it does not undo it.

    Returns:
        Plain values (step, epoch, metrics) and entries not named in ``state``. Plain values
        named in ``state`` are also updated there.

    Example:
        >>> # left = rig.load("ckpt/last", {"model": model, "optimizer": opt}); step = left["step"]
    """
    arguments.path("path", path)
    settle_pending(rig)  # a save running in the background first (it may be the one loaded)
    for reads_left in reversed(range(_READS)):
        with remote.fetched(path, sharded.first_files) as folder:  # a rank's shards come as DCP plans its reads
            try:
                return _load_folder(
                    rig, folder, state, strict, map_location=map_location, verify=verify, prepare=prepare
                )
            except _ReplacedWhileReadError as replaced:
                if not reads_left:
                    raise CheckpointError(
                        f"{path} was replaced by another save each of the {_READS} times it was read (a process "
                        f"is saving there: {type(replaced.error).__name__}: {replaced.error}); load it again"
                    ) from replaced.error
    raise AssertionError("unreachable")


_READS = 5  # reads of a checkpoint that another process replaces (or removes) while it is read


class _ReplacedWhileReadError(Exception):
    """The checkpoint folder was replaced or removed (by a save of another process) while it was
    read, before anything was loaded: ``error`` is what reading it met (``load`` reads it again)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _load_folder(
    rig: Any,
    folder: Path,
    state: dict[str, Any] | None,
    strict: bool,
    *,
    map_location: torch.device | str | None,
    verify: bool,
    prepare: Callable[[dict[str, Any]], None] | None,
) -> dict[str, Any]:
    same = folder_identity(folder)
    try:
        meta = read_meta(folder)
    except (CheckpointError, OSError) as err:
        raise (err if folder_identity(folder) == same else _ReplacedWhileReadError(err)) from None
    if state is not None and not isinstance(state, dict):
        raise TypeError(f"load() takes state as a dict of the objects to fill, got {type(state)}")
    device = torch.device(map_location) if map_location is not None else rig.device
    if meta.get("sharded"):
        loaded = sharded.load(rig, folder, meta, state, strict=strict, verify=verify, prepare=prepare)
        return update_values(state, loaded)
    entries: dict[str, dict[str, Any]] = meta["entries"]
    check_entries(folder, entries, state, strict)
    try:
        blob, tensors = read_whole(folder, meta, device, verify=verify)
    except (CheckpointError, OSError) as err:  # a file removed or swapped by a save replacing the folder?
        if folder_identity(folder) == same:
            raise
        raise _ReplacedWhileReadError(err) from None
    if folder_identity(folder) != same:  # files of two checkpoints may have been read: read it again
        raise _ReplacedWhileReadError(CheckpointError(f"{folder} was replaced while it was read; load it again"))
    if prepare is not None and state is not None:
        prepare(blob["values"])
        check_entries(folder, entries, state, strict)  # what prepare added
    return update_values(state, apply_loaded(rig, entries, blob, tensors, state, strict=strict, device=device))


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
