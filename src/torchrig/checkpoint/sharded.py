"""Sharded checkpoints (FSDP): every rank writes its own shards with ``torch.distributed.checkpoint``.

Module and optimizer states go through DCP (``get_state_dict``/``set_state_dict``, so the
layout on load may differ from the layout on save); everything else (schedulers, dataloaders,
the scaler, plain values, every rank's RNG) goes into ``state.pt`` written by rank zero. The
directory is committed exactly like a whole checkpoint: temp dir, fsync, ``meta.json`` with the
SHA-256 of every file, rename.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchrig.checkpoint.files import CheckpointError

DCP_METADATA = ".metadata"
# What a DCP ``.metadata`` pickle may name: DCP's own dataclasses and torch's dtype/size types.
_SAFE_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # DCP records the checkpoint_id it was saved to
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict unpickling: only allow-listed globals can be named."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise CheckpointError(
            f"refusing to load {self.path}: it names the Python object {module}.{name}, which could run "
            "code when unpickled; a DCP metadata file only holds DCP's own classes"
        )

    path: Path


def check_dcp_metadata(path: Path) -> None:
    """Refuse a ``.metadata`` pickle naming anything but DCP's classes and torch dtypes.

    DCP unpickles this file with plain ``pickle``; reading it first through a restricted
    unpickler (nothing outside the allow-list can be named, so nothing else can be called)
    keeps a stranger's checkpoint from executing code.
    """
    from torchrig.checkpoint.files import open_regular

    with io.BufferedReader(open_regular(path)) as f:  # never a link, FIFO or device
        unpickler = _MetadataUnpickler(f)
        unpickler.path = path
        try:
            unpickler.load()
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{path} is not a readable DCP metadata file: {err}") from err


def _owner(module_items: dict[str, nn.Module], optimizer: torch.optim.Optimizer) -> nn.Module:
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in module_items.values():
        if any(id(p) in params for p in module.parameters()):
            return module
    raise ValueError(
        "a sharded checkpoint saves an optimizer through the module it optimizes; put that module in "
        "the same state dict (for example {'model': model, 'optimizer': optimizer})"
    )


def split(state: dict[str, Any]) -> tuple[dict[str, nn.Module], dict[str, Any], dict[str, Any]]:
    """Modules, optimizers (real ones, unwrapped), and the rest of ``state``."""
    from torchrig.checkpoint.state import unwrap_module

    modules = {k: unwrap_module(v) for k, v in state.items() if isinstance(v, nn.Module)}
    optims = {k: getattr(v, "optimizer", v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optims}
    return modules, optims, rest


def dcp_state(modules: dict[str, nn.Module], optims: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {k: get_model_state_dict(m) for k, m in modules.items()}
    for k, o in optims.items():
        out[k] = get_optimizer_state_dict(_owner(modules, o), o)
    return out


def save(rig: Any, target: Path, state: dict[str, Any], *, keep_last: int | None, link: str | None) -> Path:
    """Every rank writes its shards into one temp dir; rank zero hashes, describes and commits it."""
    import torch.distributed.checkpoint as dcp

    from torchrig.checkpoint import core
    from torchrig.checkpoint.files import discard, remove_stale_temps, temp_dir_for

    modules, optims, rest = split(state)
    shards = dcp_state(modules, optims)
    payload = core.collect(rig, rest)
    if rig.is_global_zero:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target.parent)
    tmp = Path(rig.broadcast(str(temp_dir_for(target)) if rig.is_global_zero else None))
    error: BaseException | None = None
    try:
        dcp.save(shards, checkpoint_id=tmp)  # FileSystemWriter fsyncs every file it writes
    except BaseException as err:
        error = err
    failed = not rig.reduce_boolean_decision(error is None, all=True)
    if rig.is_global_zero and not failed:
        try:
            _finish(rig, tmp, target, payload, modules, optims, keep_last=keep_last, link=link)
        except BaseException as err:
            error = err
    if rig.is_global_zero and (failed or error is not None):
        discard(tmp)
    msg = rig.broadcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if msg is not None or failed:
        raise RuntimeError(f"saving the sharded checkpoint {target} failed on another rank: {msg or 'see its log'}")
    return target


def _finish(
    rig: Any,
    tmp: Path,
    target: Path,
    payload: dict[str, Any],
    modules: dict[str, nn.Module],
    optims: dict[str, Any],
    *,
    keep_last: int | None,
    link: str | None,
) -> None:
    """Rank zero, once every shard is written: ``state.pt``, checksums, ``meta.json``, rename."""
    from torchrig.checkpoint import core
    from torchrig.checkpoint.files import (
        FileSet,
        apply_retention,
        commit,
        hash_existing,
        update_link,
        write_meta,
        write_torch,
    )

    core.check_weights_only(payload["blob"])
    with FileSet(tmp) as files:
        files.add(core.STATE_FILE, functools.partial(write_torch, obj=payload["blob"]))
        table = files.finish()
    table.update(hash_existing(tmp, [p.name for p in tmp.iterdir() if p.name != core.STATE_FILE]))
    entries = dict(payload["entries"])
    entries.update({k: {"kind": "module", "type": core._qualname(m), "dcp": True} for k, m in modules.items()})
    entries.update({k: {"kind": "optimizer", "type": core._qualname(o), "dcp": True} for k, o in optims.items()})
    meta = core.base_meta(rig, entries, payload["blob"]["values"])
    meta.update(sharded=True, files=table, **_counts(tmp, list(modules)))
    write_meta(tmp, meta)
    commit(tmp, target)
    if link:
        update_link(target, link)
    if keep_last is not None:
        apply_retention(target, keep_last)


def _counts(folder: Path, module_keys: list[str]) -> dict[str, int]:
    """Tensor and parameter counts of the modules' shards, from DCP's metadata (full shapes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(folder)).read_metadata()  # the file this save just wrote
    prefixes = tuple(f"{k}." for k in module_keys)
    tensors = [
        v for k, v in md.state_dict_metadata.items() if k.startswith(prefixes) and isinstance(v, TensorStorageMetadata)
    ]
    floating = [v for v in tensors if v.properties.dtype.is_floating_point]
    return {"tensors": len(tensors), "parameters": sum(int(torch.Size(v.size).numel()) for v in floating)}


def _safe_planner(*, keys: list[str] | None = None) -> Any:
    """DCP's load planner, but non-tensor items are read with ``weights_only=True``.

    DCP's default ``load_bytes`` unpickles with weights-only checking turned off; with ``keys`` the planner
    builds the state dict from the checkpoint itself (for consolidation, no model needed).
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore[attr-defined]
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            if keys is None:  # the targets are given: plain DefaultLoadPlanner behaviour
                DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)
            else:
                super().set_up_planner(state_dict, metadata, is_coordinator)

    return SafeLoadPlanner(keys=keys)


@contextlib.contextmanager
def _refuse_code(folder: Path) -> Iterator[None]:
    """DCP reports our planner's weights_only refusal wrapped per rank; say it plainly."""
    try:
        yield
    except Exception as err:
        if "Weights only load failed" not in str(err):
            raise
        raise CheckpointError(
            f"refusing to load {folder}: a shard holds Python objects other than tensors and plain "
            "containers, which could run code when unpickled; torchrig only loads weights_only data"
        ) from None


def load(
    rig: Any, folder: Path, meta: dict[str, Any], state: dict[str, Any] | None, *, strict: bool, verify: bool
) -> dict[str, Any]:
    """Load shards into the modules and optimizers of ``state`` in this process's layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from torchrig.checkpoint import core
    from torchrig.checkpoint.files import VerifiedReader, safe_torch_load

    if state is None:
        raise ValueError(
            f"{folder} is a sharded checkpoint: load it into objects (rig.load(path, {{'model': model, ...}})), "
            f"or make one file of it with `torchrig checkpoint consolidate {folder} OUT`"
        )
    modules, optims, rest = split(state)
    entries = meta["entries"]
    missing = [k for k in state if k not in entries]
    if missing and strict:
        raise CheckpointError(f"the checkpoint {folder} has no entries {missing}; it has {sorted(entries)}")
    with VerifiedReader(folder, meta, verify=verify) as reader:
        for name in meta["files"]:
            reader.path(name)
        reader.check()
        blob = safe_torch_load(reader.path(core.STATE_FILE), map_location=rig.device)
    check_dcp_metadata(folder / DCP_METADATA)
    _compare(folder, modules, strict)
    _check_before_dcp(entries, blob, modules, optims, rest, strict=strict)
    shards = dcp_state(
        {k: m for k, m in modules.items() if k in entries}, {k: o for k, o in optims.items() if k in entries}
    )
    with _refuse_code(folder):
        dcp.load(shards, checkpoint_id=folder, planner=_safe_planner())
    for k, m in modules.items():
        if k in shards:
            set_model_state_dict(m, shards[k])
    for k, o in optims.items():
        if k in shards:
            set_optimizer_state_dict(_owner(modules, o), o, shards[k])
    return core._apply(rig, folder, entries, blob, {}, rest, strict=strict, device=rig.device)


def _check_before_dcp(
    entries: dict[str, Any],
    blob: dict[str, Any],
    modules: dict[str, nn.Module],
    optims: dict[str, Any],
    rest: dict[str, Any],
    *,
    strict: bool,
) -> None:
    """What :func:`core.check_load` checks, before DCP writes into the modules (they change as it reads)."""
    from torchrig.checkpoint import core
    from torchrig.checkpoint.state import is_stateful, raise_if

    objects = {k: o for k, o in rest.items() if k in entries and is_stateful(o)}
    named = {k: m for k, m in modules.items() if k in entries}
    found = core.check_load(entries, blob, {}, named, objects, strict=strict)
    problems = [found] if found else []
    problems += [
        f"checkpoint entry {k!r} was saved from a {entries[k]['type']}, not the {core._qualname(o)} given"
        for k, o in optims.items()
        if k in entries and entries[k]["type"] != core._qualname(o)
    ]
    raise_if("\n".join(problems) or None)


def _compare(folder: Path, modules: dict[str, nn.Module], strict: bool) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from torchrig.checkpoint.state import compare_module

    md = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    problems = []
    for key, module in modules.items():
        saved = {
            name[len(key) + 1 :]: torch.empty(v.size, device="meta")
            for name, v in md.items()
            if name.startswith(key + ".") and isinstance(v, TensorStorageMetadata)
        }
        own = {k: v for k, v in get_model_state_dict(module).items() if isinstance(v, torch.Tensor)}
        _, message = compare_module(key, own, saved)
        if message and strict:
            problems.append(message.replace("its module", f"the module {type(module).__name__}"))
    if problems:
        raise CheckpointError("\n".join(problems))


def consolidate_dcp(folder: Path, meta: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The full tensors of every module entry of a sharded checkpoint, read in this one process."""
    from torch.distributed.checkpoint import FileSystemReader

    from torchrig.checkpoint.files import VerifiedReader

    with VerifiedReader(folder, meta) as reader:
        for name in meta["files"]:
            reader.path(name)
        reader.check()
    check_dcp_metadata(folder / DCP_METADATA)
    keys = [k for k, e in meta["entries"].items() if e["kind"] == "module"]
    # What dcp_to_torch_save does (it is DCP's own converter), but with the weights_only planner.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    with _refuse_code(folder):
        shards = FileSystemReader(str(folder))
        _load_state_dict(sd, storage_reader=shards, planner=_safe_planner(keys=keys), no_dist=True)
    return {k: {n: t for n, t in sd.get(k, {}).items() if isinstance(t, torch.Tensor)} for k in keys}
