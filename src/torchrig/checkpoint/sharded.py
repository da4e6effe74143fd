"""Sharded checkpoints (FSDP): every rank writes its own shards with ``torch.distributed.checkpoint``.

Module and optimizer states go through DCP (``get_state_dict``/``set_state_dict``, so the
layout on load may differ from the layout on save); everything else (schedulers, dataloaders,
the scaler, plain values, every rank's RNG) goes into ``state.pt`` written by rank zero. The
directory is committed exactly like a whole checkpoint: temp dir, fsync, ``meta.json`` with the
SHA-256 of every file, rename.

``torch.distributed.checkpoint`` is imported by the functions that use it: it is slow to import
(see ``python -X importtime -c "import torchrig"``), and a run that never saves sharded never pays that.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import pathlib
import pickle
import pickletools
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrig.checkpoint.background import host_buffers, to_host
from torchrig.checkpoint.compare import compare_module, load_problems
from torchrig.checkpoint.entries import base_meta, collect, is_stateful, module_counts, qualname, user_module
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.files import (
    FileSet,
    apply_retention,
    commit,
    discard,
    hash_existing,
    raise_no_space,
    remove_stale_temps,
    temp_dir_for,
    update_link,
    write_meta,
    write_torch,
)
from torchrig.checkpoint.meta import DCP_METADATA, STATE_FILE
from torchrig.checkpoint.reading import VerifiedReader, read_regular, safe_torch_load
from torchrig.checkpoint.restore import apply_loaded
from torchrig.checkpoint.storable import check_weights_only
from torchrig.checkpoint.tensors import payload_bytes


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` pickle names, as ``(module, name)`` -> the object itself.

    Exact pairs only (never a module prefix, never a dotted name): DCP's metadata dataclasses and
    enum, the record of where each item lies in a shard file, ``torch.Size``, torch's dtypes and
    layouts, and the ``pathlib`` class of the folder DCP saved to.
    """
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], Any] = {}
    dcp_classes = {
        "torch.distributed.checkpoint.metadata": (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        ),
        "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    }
    modules = {"torch.distributed.checkpoint.metadata": metadata, "torch.distributed.checkpoint.filesystem": filesystem}
    for module, names in dcp_classes.items():
        table.update({(module, n): getattr(modules[module], n) for n in names if hasattr(modules[module], n)})
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):  # dtypes, layouts and memory formats are pickled by name: data, not callables
        if isinstance(getattr(torch, name), (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", name)] = getattr(torch, name)
    native = type(pathlib.Path()).__name__
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        cls = getattr(pathlib, name if name.startswith("Pure") or name == native else f"Pure{name}")
        for module in ("pathlib", "pathlib._local"):  # where Python 3.13 defines them
            table[(module, name)] = cls  # a path saved on another OS is kept as its pure path
    return table


# Opcodes that only build data (or that the unpickler below restricts); the others (INST, OBJ,
# NEWOBJ_EX, EXT*, PERSID, out-of-band buffers) are never in a DCP metadata file and are refused.
_DATA_OPCODES = frozenset(
    """PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4
    FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES
    SHORT_BINBYTES BINBYTES8 BYTEARRAY8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST LIST APPEND APPENDS
    EMPTY_DICT DICT SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT
    MEMOIZE GLOBAL STACK_GLOBAL REDUCE NEWOBJ BUILD""".split()  # noqa: SIM905
)


class _RefusedOpcodes(dict):  # type: ignore[type-arg]
    def __missing__(self, code: int) -> Any:
        name = next((op.name for op in pickletools.opcodes if op.code == chr(code)), f"{code:#04x}")
        raise _RefusedError(f"it uses the pickle opcode {name}, which a DCP metadata file never holds")


class _RefusedError(Exception):
    pass


class _MetadataUnpickler(pickle._Unpickler):
    """A pickle reader that can only build DCP's metadata: exact allow-listed globals, data opcodes,
    and calls (``REDUCE``, ``NEWOBJ``) and attribute restores (``BUILD``) of the allow-listed classes only.

    Python's pure-Python unpickler, with its opcode table cut down: the C one cannot be kept from
    ``BUILD`` setting attributes on an allowed class itself (patching it for the whole process).
    """

    stack: list[Any]  # the unpickler's stack (pickle._Unpickler's own attribute)
    dispatch = _RefusedOpcodes(
        {
            op.code.encode("latin-1")[0]: pickle._Unpickler.dispatch[op.code.encode("latin-1")[0]]
            for op in pickletools.opcodes
            if op.name in _DATA_OPCODES
        }
    )

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file)
        table = _metadata_globals()
        self._callables = {id(v): v for v in table.values() if callable(v)}
        self._classes = {v for v in table.values() if isinstance(v, type)}

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
        if found is None:
            raise _RefusedError(f"it names the Python object {name!r} of module {module!r}")
        return found

    def _call(self, func: Any) -> None:
        if id(func) not in self._callables:
            raise _RefusedError(f"it calls a {type(func).__name__}, {func!r:.80}")

    def load_reduce(self) -> None:
        self._call(self.stack[-2])
        super().load_reduce()  # type: ignore[misc]

    def load_newobj(self) -> None:
        self._call(self.stack[-2])
        super().load_newobj()  # type: ignore[misc]

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type):  # would patch the class for the whole process
            raise _RefusedError(f"it sets attributes of the class {inst.__module__}.{inst.__qualname__}")
        if type(inst) not in self._classes:
            raise _RefusedError(f"it sets attributes of a {type(inst).__name__}")
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise _RefusedError(f"it sets the attributes {list(part)} of a {type(inst).__name__}")
        super().load_build()  # type: ignore[misc]

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def parse_dcp_metadata(path: Path, data: bytes, files: Collection[str]) -> Any:
    """DCP's ``Metadata`` from the bytes of ``path``, without running anything they name.

    DCP itself reads this file with plain ``pickle.load``; torchrig reads it here instead (and hands
    the result to DCP through :func:`_reader`), so a pickle payload is refused before it runs: a
    :class:`CheckpointError` naming the file and the global. Every shard file it points DCP at must
    be one of ``files`` (listed in ``meta.json``, so checked like the rest).
    """
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedError as err:
        raise CheckpointError(
            f"refusing to load {path}: {err}, which could run code when unpickled; a DCP metadata file only "
            "holds DCP's own classes, torch.Size and dtypes, and nothing in it was run"
        ) from None
    except Exception as err:
        raise CheckpointError(f"{path} is not a readable DCP metadata file: {type(err).__name__}: {err}") from None
    if (
        type(md) is not Metadata
        or not isinstance(md.state_dict_metadata, dict)
        or not isinstance(md.storage_data, dict)
        or not isinstance(md.planner_data, (dict, type(None)))
    ):
        raise CheckpointError(f"{path} is not a DCP metadata file: it holds a {type(md).__name__}")
    for info in md.storage_data.values():
        ok = (
            type(info) is filesystem._StorageInfo and info.relative_path in files and info.relative_path != DCP_METADATA
        )
        if not ok or not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise CheckpointError(
                f"{path} points at {getattr(info, 'relative_path', info)!r}, which is not a shard file listed in "
                "meta.json; refusing to read it"
            )
    count = len(md.state_dict_metadata)  # where a list index in an item's path is bounded (DCP grows lists to it)
    for key, where in (md.planner_data or {}).items():
        if not isinstance(where, tuple) or not all(
            isinstance(k, str) or (type(k) is int and 0 <= k <= count) for k in where
        ):
            raise CheckpointError(f"{path} gives the item {key!r} the path {where!r:.100}, not a state-dict path")
    return md


def read_dcp_metadata(path: Path, hashing: bool, *, files: Collection[str]) -> tuple[Any, str | None]:
    """:func:`parse_dcp_metadata` of a file read once, and the SHA-256 of those bytes (for
    :meth:`VerifiedReader.submit`: the bytes checked are the bytes parsed and given to DCP)."""
    data = read_regular(path)  # never a link, FIFO or device
    return parse_dcp_metadata(path, data, files), hashlib.sha256(data).hexdigest() if hashing else None


def _verified_metadata(reader: Any, meta: dict[str, Any]) -> Any:
    """Start checking every file of a sharded checkpoint; DCP's metadata, parsed safely and verified."""
    for name in meta["files"]:
        if name != DCP_METADATA:
            reader.path(name)
    job = reader.submit(DCP_METADATA, functools.partial(read_dcp_metadata, files=frozenset(meta["files"])))
    md = job.result()
    reader.check()
    return md


def _reader(folder: Path, md: Any) -> Any:
    """DCP's file reader for ``folder``, whose metadata is ``md`` (already read safely), never the file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # what FileSystemReader does after unpickling
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return CheckedReader(str(folder))


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
    modules = {k: user_module(v) for k, v in state.items() if isinstance(v, nn.Module)}
    optims = {k: getattr(v, "optimizer", v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optims}
    return modules, optims, rest


def dcp_state(modules: dict[str, nn.Module], optims: dict[str, Any]) -> dict[str, Any]:
    """DCP's state dicts of ``modules`` and ``optims`` (each optimizer through the module it optimizes)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {k: get_model_state_dict(m) for k, m in modules.items()}
    for k, o in optims.items():
        out[k] = get_optimizer_state_dict(_owner(modules, o), o)
    return out


def start(
    rig: Any, target: Path, state: dict[str, Any], *, keep_last: int | None, link: str | None, blocking: bool
) -> Callable[[], None]:
    """Every rank hands its shards to DCP, all into one temp dir; returns this rank's job: wait
    until the shards are written, then (rank zero) hash, describe and commit the directory.

    With ``blocking=False`` DCP's ``async_save`` (thread mode) copies the shards to host memory
    here and writes them on its own thread, its collectives on a process group of their own
    (:func:`_save_group`) so they never meet the training's on the default group.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    modules, optims, rest = split(state)
    shards = dcp_state(modules, optims)
    payload = collect(rig, rest)
    if rig.is_global_zero:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target.parent)
    tmp = Path(rig.broadcast(str(temp_dir_for(target)) if rig.is_global_zero else None))
    ready: Callable[[], None] | None = None
    if blocking:
        written: Callable[[], Any] = functools.partial(dcp.save, shards, checkpoint_id=tmp)
    else:
        buffers = host_buffers(rig)
        if buffers.dcp_stager is None:  # a copy in (pinned) host memory, reused by the next save
            cuda = rig.device.type == "cuda"
            buffers.dcp_stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        future = dcp.async_save(
            shards,
            checkpoint_id=tmp,
            process_group=_save_group(rig),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,  # its process mode hung on CPU
            async_stager=buffers.dcp_stager,
        )
        written = future.result  # type: ignore[union-attr]  # a Future: no async_stager returns a response
        if rig.is_global_zero:
            snapshot = to_host(payload["blob"], host_buffers(rig))  # no optimizer: DCP's
            payload, ready = {**payload, "blob": snapshot.tree}, snapshot.ready

    def job() -> None:
        try:
            written()  # FileSystemWriter fsyncs every file; a failure on any rank is raised on every rank
            if rig.is_global_zero:
                if ready is not None:
                    ready()
                _finish(rig, tmp, target, payload, modules, optims, keep_last=keep_last, link=link)
        except BaseException as err:
            if rig.is_global_zero:
                discard(tmp)
            blob_bytes = payload_bytes({"modules": {}, "blob": payload["blob"]})
            needed = rig.world_size * _local_bytes(shards) + blob_bytes
            raise_no_space(err, target, needed)
            raise

    return job


def _save_group(rig: Any) -> Any:
    """The process group (gloo, every rank) of background sharded saves, made at the first one
    (every rank calls ``rig.save``, so every rank makes it at the same point)."""
    group = getattr(rig, "_save_group", None)
    if group is None:
        group = rig._save_group = dist.new_group(backend="gloo")
    return group


def _local_bytes(shards: dict[str, Any]) -> int:
    """The bytes of this rank's part of the tensors in ``shards`` (a DTensor counts its local shard)."""
    total, stack = 0, [shards]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            total += local.nbytes
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


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
    check_weights_only(payload["blob"])
    with FileSet(tmp) as files:
        files.add(STATE_FILE, functools.partial(write_torch, obj=payload["blob"]))
        table = files.finish()
    table.update(hash_existing(tmp, [p.name for p in tmp.iterdir() if p.name != STATE_FILE]))
    entries = dict(payload["entries"])
    entries.update({k: {"kind": "module", "type": qualname(m), "dcp": True} for k, m in modules.items()})
    entries.update({k: {"kind": "optimizer", "type": qualname(o), "dcp": True} for k, o in optims.items()})
    meta = base_meta(rig, entries, payload["blob"]["values"])
    md = parse_dcp_metadata(tmp / DCP_METADATA, read_regular(tmp / DCP_METADATA), files=table)  # as loads read it
    counts = module_counts(modules.values())  # full sizes: a DTensor's numel is the whole tensor's
    meta.update(sharded=True, files=table, tensors=_count_tensors(md, list(modules)), **counts)
    write_meta(tmp, meta)
    commit(tmp, target)
    if link:
        update_link(target, link)
    if keep_last is not None:
        apply_retention(target, keep_last)


def _count_tensors(md: Any, module_keys: list[str]) -> int:
    """How many tensors the modules' shards hold, from DCP's metadata ``md``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefixes = tuple(f"{k}." for k in module_keys)
    return sum(
        1 for k, v in md.state_dict_metadata.items() if k.startswith(prefixes) and isinstance(v, TensorStorageMetadata)
    )


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
        md = _verified_metadata(reader, meta)
        blob = safe_torch_load(reader.path(STATE_FILE), map_location=rig.device)
    _compare(md, modules, strict)
    _check_before_dcp(entries, blob, modules, optims, rest, strict=strict)
    shards = dcp_state(
        {k: m for k, m in modules.items() if k in entries}, {k: o for k, o in optims.items() if k in entries}
    )
    with _refuse_code(folder):
        dcp.load(shards, storage_reader=_reader(folder, md), planner=_safe_planner())
    for k, m in modules.items():
        if k in shards:
            set_model_state_dict(m, shards[k])
    for k, o in optims.items():
        if k in shards:
            set_optimizer_state_dict(_owner(modules, o), o, shards[k])
    return apply_loaded(rig, entries, blob, {}, rest, strict=strict, device=rig.device)


def _check_before_dcp(
    entries: dict[str, Any],
    blob: dict[str, Any],
    modules: dict[str, nn.Module],
    optims: dict[str, Any],
    rest: dict[str, Any],
    *,
    strict: bool,
) -> None:
    """What :func:`~torchrig.checkpoint.compare.load_problems` checks, and the optimizers' classes,
    before DCP writes into the modules (they change as it reads)."""
    objects = {k: o for k, o in rest.items() if k in entries and is_stateful(o)}
    named = {k: m for k, m in modules.items() if k in entries}
    problems = load_problems(entries, blob, {}, named, objects, strict=strict)
    problems += [
        f"checkpoint entry {k!r} was saved from a {entries[k]['type']}, not the {qualname(o)} given"
        for k, o in optims.items()
        if k in entries and entries[k]["type"] != qualname(o)
    ]
    if problems:
        raise CheckpointError("\n".join(problems))


def _compare(dcp_metadata: Any, modules: dict[str, nn.Module], strict: bool) -> None:
    """Refuse modules whose names or shapes differ from the shards' (``strict``), before DCP reads."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    md = dcp_metadata.state_dict_metadata
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
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    with VerifiedReader(folder, meta) as reader:
        md = _verified_metadata(reader, meta)
    keys = [k for k, e in meta["entries"].items() if e["kind"] == "module"]
    # What dcp_to_torch_save does (it is DCP's own converter), but with the weights_only planner.
    sd: dict[str, Any] = {}
    with _refuse_code(folder):
        _load_state_dict(sd, storage_reader=_reader(folder, md), planner=_safe_planner(keys=keys), no_dist=True)
    return {k: {n: t for n, t in sd.get(k, {}).items() if isinstance(t, torch.Tensor)} for k in keys}
