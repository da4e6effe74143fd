"""Tensors <-> safetensors files: module weights (tied ones stored once, cut into shards) and the
large tensors of ``state.pt`` (optimizer moments), written, hashed and read on several threads."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from torchrig.checkpoint import files  # files.durable: the one place a written file is fsynced
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.reading import VerifiedReader, sha256_file

ALIASES_KEY = "torchrig.aliases"
SHARD_BYTES = 256 << 20  # safetensors files are cut at about this size
EXTRACT_BYTES = 1 << 20  # tensors of the other state this large go to safetensors files


# -- module tensors -> safetensors ---------------------------------------------------------
def split_module_state(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (for safetensors) and the rest (``get_extra_state`` objects) of a module state dict."""
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    extras = {k: v for k, v in sd.items() if not isinstance(v, torch.Tensor)}
    return tensors, extras


def for_safetensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts, and metadata recording tied tensors.

    safetensors refuses tensors that share memory, so a tensor that is exactly another one
    (tied weights) is written once under its first name and recorded as an alias; views that
    only overlap are copied, and non-contiguous tensors made contiguous.
    """
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        ptr = t.untyped_storage().data_ptr()
        ident = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        if t.numel() and ptr in storages:
            t = t.clone()
        elif not t.is_contiguous():
            t = t.contiguous()
        storages.add(ptr)
        seen[ident] = name
        out[name] = t
    return out, {ALIASES_KEY: json.dumps(aliases)}


def write_safetensors(
    path: Path, fsync: bool, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> str:
    """Write ``tensors`` (ready for safetensors) to ``path`` (fsynced with ``fsync``); returns the file's SHA-256."""
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)  # straight from tensor memory
    files.follow_umask(path)
    if not fsync:
        return sha256_file(path)
    # The hash reads the file back from the page cache while the disk flushes it: no extra copy.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-fsync") as pool:
        flushed = pool.submit(files.durable, path)
        digest = sha256_file(path)
        flushed.result()
    return digest


def shard(tensors: dict[str, torch.Tensor], max_bytes: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in order, cut into groups of about ``max_bytes`` (default :data:`SHARD_BYTES`).

    Several files are written, fsynced, hashed and verified on several threads at once: SHA-256
    runs at about 1 GB/s per core, so one big file would keep one core busy while others idle.
    """
    limit = SHARD_BYTES if max_bytes is None else max_bytes
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + t.nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += t.nbytes
    return groups


def shard_names(prefix: str, n: int) -> list[str]:
    """``model.safetensors`` for one file, ``model@00000.safetensors``... for several.

    State keys cannot hold ``@``, so these names never meet another entry's file.
    """
    return [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}@{i:05d}.safetensors" for i in range(n)]


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file, mapped from the page cache (no copy).

    Read once every checksum matched (:meth:`VerifiedReader.read`, then :meth:`VerifiedReader.check`):
    ``load_state_dict`` copies module weights into the parameters, and ``load`` copies what it
    returns.
    """
    with safetensors.safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        return tensors, f.metadata() or {}


def retie(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    """Put back the tied tensors :func:`for_safetensors` stored once."""
    for alias, name in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
        tensors[alias] = tensors[name]
    return tensors


# -- large tensors of the other state -> safetensors ---------------------------------------
_EXTRACT_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}  # fmt: skip


def _extractable(t: Any, min_bytes: int, seen: set[int]) -> bool:
    """A plain tensor that owns all of its storage: safetensors keeps everything about it."""
    if type(t) is not torch.Tensor or t.requires_grad or t.layout != torch.strided or t.device.type == "meta":
        return False
    if t.dtype not in _EXTRACT_DTYPES or t.nbytes < min_bytes or not t.is_contiguous() or t.storage_offset():
        return False
    ptr = t.untyped_storage().data_ptr()
    if t.untyped_storage().nbytes() != t.nbytes or ptr in seen:
        return False  # a view, or storage shared with another tensor: torch.save keeps that sharing
    seen.add(ptr)
    return True


def extract_tensors(obj: Any, min_bytes: int | None = None) -> tuple[Any, dict[str, torch.Tensor], list[Any]]:
    """``obj`` with its large tensors replaced by ``None``, those tensors, and where they were.

    Only plain dicts (str/int keys) and lists are walked; the places (key paths) go into the
    pickle, which is itself checksummed, and :func:`restore_tensors` puts the tensors back.
    Optimizer moments thus go to safetensors files, hashed and read on several threads.
    """
    limit = EXTRACT_BYTES if min_bytes is None else min_bytes
    tensors: dict[str, torch.Tensor] = {}
    where: list[Any] = []
    seen: set[int] = set()

    def walk(x: Any, path: list[Any]) -> Any:
        if type(x) is dict:
            return {k: walk(v, [*path, k]) if type(k) in (str, int) else v for k, v in x.items()}
        if type(x) is list:
            return [walk(v, [*path, i]) for i, v in enumerate(x)]
        if path and _extractable(x, limit, seen):
            name = f"t{len(tensors)}"
            tensors[name] = x
            where.append([path, name])
            return None
        return x

    return walk(obj, []), tensors, where


def restore_tensors(obj: Any, where: list[Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Undo :func:`extract_tensors` in place, the tensors moved to ``device``."""
    for path, name in where:
        node = obj
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = tensors[name].to(device)


def add_tensor_files(fileset: files.FileSet, prefix: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Queue ``tensors`` as one or more safetensors files (tied ones stored once); their names."""
    out, metadata = for_safetensors(tensors)
    groups = shard(out)
    names = shard_names(prefix, len(groups))
    for name, group in zip(names, groups, strict=True):
        fileset.add(name, functools.partial(write_safetensors, tensors=group, metadata=metadata))
    return names


def read_tensor_files(reader: VerifiedReader, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors files ``names`` (one entry, maybe several shards), on CPU,
    mapped from the files: :meth:`VerifiedReader.check` must pass before they are used."""
    merged: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name in names:
        tensors, meta = reader.read(name, read_safetensors)
        merged.update(tensors)
        metadata.update(meta)
    try:
        return retie(merged, metadata)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"the tied-tensor list of {names} names a missing tensor ({err}); damaged") from err


def module_files(entry: dict[str, Any]) -> list[str]:
    """The safetensors files of a module entry (format 1 had one, ``file``)."""
    return list(entry["files"] if "files" in entry else [entry["file"]])


def payload_bytes(payload: dict[str, Any]) -> int:
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
