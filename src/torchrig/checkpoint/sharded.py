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

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.torch_version import TorchVersion

from torchrig.checkpoint import remote
from torchrig.checkpoint.compare import compare_module, load_problems
from torchrig.checkpoint.dcp_safe import (
    checked_reader,
    parse_dcp_metadata,
    refuse_code,
    safe_planner,
)
from torchrig.checkpoint.entries import (
    base_meta,
    check_entries,
    collect,
    is_stateful,
    module_counts,
    qualname,
    user_module,
)
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.failures import uncommitted
from torchrig.checkpoint.files import (
    FileSet,
    discard,
    hash_existing,
    prepare_target,
    publish,
    write_torch,
)
from torchrig.checkpoint.meta import DCP_METADATA, STATE_FILE
from torchrig.checkpoint.rank_buffers import restore_rank_buffers
from torchrig.checkpoint.reading import VerifiedReader, read_regular, safe_torch_load
from torchrig.checkpoint.remote import CheckpointURL
from torchrig.checkpoint.restore import apply_loaded
from torchrig.checkpoint.snapshot import host_buffers, to_host
from torchrig.checkpoint.storable import check_weights_only
from torchrig.checkpoint.tensors import payload_bytes


def first_files(meta: dict[str, Any]) -> list[str]:
    """The files a read of the checkpoint ``meta`` describes needs before it knows which shards it
    reads: every file of a whole checkpoint; of a sharded one ``state.pt`` and DCP's ``.metadata``
    (the shards come when DCP's read plan names them, :func:`_shards_ready`). What
    :func:`~torchrig.checkpoint.remote.fetched` downloads first."""
    if not meta.get("sharded"):
        return list(meta["files"])
    return [STATE_FILE, DCP_METADATA]


def _verified_metadata(reader: Any, meta: dict[str, Any]) -> Any:
    """DCP's metadata, parsed safely once its bytes match ``meta.json`` (and every file whose
    check ``reader`` has started is checked too)."""
    data = reader.checked_bytes(DCP_METADATA)  # compared with meta.json before it is parsed
    md = parse_dcp_metadata(reader.folder / DCP_METADATA, data, files=frozenset(meta["files"]))
    reader.check()
    return md


def _shards_ready(folder: Path, meta: dict[str, Any], *, verify: bool) -> Callable[[set[str]], None]:
    """What DCP's reader calls with the shard files this rank reads: each downloaded if the
    checkpoint is on object storage (only these), then checked against its size and SHA-256."""

    def ready(names: set[str]) -> None:
        remote.fetch_listed(folder, names)
        with VerifiedReader(folder, meta, verify=verify) as reader:
            for name in sorted(names):
                reader.path(name)
            reader.check()

    return ready


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


def _optimizer_options(key: str, nested: frozenset[str]) -> Any:
    """DCP's options for optimizer ``key``: flat, its hyperparameters per parameter name
    (``param_groups.<name>.lr``), so every pipeline stage saves and finds its own groups; the
    optimizers of ``nested`` per group index (``param_groups.0.lr``): those without per-parameter
    state (DCP's flat form cannot load that) and those of checkpoints saved before the flat form."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=key not in nested)


def _nested_in(md: Any, optims: dict[str, Any]) -> frozenset[str]:
    """The optimizers of ``optims`` that DCP's metadata ``md`` holds per group index (``param_groups.0.params``)."""
    return frozenset(k for k in optims if f"{k}.param_groups.0.params" in md.state_dict_metadata)


def dcp_state(
    modules: dict[str, nn.Module],
    optims: dict[str, Any],
    stateless: frozenset[str],
    nested: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """DCP's state dicts of ``modules`` and ``optims`` (each optimizer through the module it optimizes;
    its groups' hyperparameters per parameter name, or per group index for those of ``nested``).

    ``stateless`` names the optimizers whose state dict is to hold no per-parameter state: one
    saved before its first step, or loaded from such a checkpoint. DCP's
    ``get_optimizer_state_dict`` makes state for an optimizer without any by running ``step()``
    with zero gradients (AdamW's step counter then runs one ahead); that state is taken away again,
    so neither a save nor a load changes the optimizer beyond what the checkpoint holds.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {k: get_model_state_dict(m) for k, m in modules.items()}
    nested = nested | stateless
    for k, o in optims.items():
        fresh = not o.state
        out[k] = get_optimizer_state_dict(_owner(modules, o), o, options=_optimizer_options(k, nested))
        if k in stateless:
            out[k]["state"] = {}
            if fresh:
                o.state.clear()  # DCP's zero step made it
    return out


def _stateless_in(md: Any, optims: dict[str, Any]) -> frozenset[str]:
    """The optimizers of ``optims`` that DCP's metadata ``md`` holds no per-parameter state for."""
    keys = md.state_dict_metadata
    return frozenset(k for k in optims if not any(name.startswith(f"{k}.state.") for name in keys))


def start(
    rig: Any,
    target: Path | CheckpointURL,
    state: dict[str, Any],
    *,
    keep_last: int | None,
    link: str | None,
    blocking: bool,
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
    shards = dcp_state(modules, optims, frozenset(k for k, o in optims.items() if not o.state))
    payload = collect(rig, rest, sharded_modules=modules)
    made: tuple[str, str] | None = None
    if rig.is_global_zero:
        try:
            with uncommitted(target, lambda: 0):
                if isinstance(target, CheckpointURL):
                    made = ("tmp", remote.begin(target, link))
                else:
                    made = ("tmp", str(prepare_target(target, link)))
        except CheckpointError as err:  # every rank refuses the save, none is left waiting
            made = ("refused", str(err))
    kind, text = rig.broadcast(made)
    if kind == "refused":
        raise CheckpointError(text)
    out = _Output(target, text)
    ready: Callable[[], None] | None = None
    if blocking:
        written: Callable[[], Any] = functools.partial(dcp.save, shards, **out.dcp_destination)
    else:
        buffers = host_buffers(rig)
        stager = buffers.dcp_stager
        if stager is None:  # a copy in (pinned) host memory
            cuda = rig.device.type == "cuda"
            stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
            if STAGER_REUSABLE:
                buffers.dcp_stager = stager  # the next save reuses its host copies
        future = dcp.async_save(
            shards,
            **out.dcp_destination,
            process_group=_save_group(rig),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,  # its process mode hung on CPU
            async_stager=stager,
        )
        written = future.result  # type: ignore[union-attr]  # a Future: no async_stager returns a response
        if buffers.dcp_stager is not stager:  # used once: closed when its save is written
            written = _then_close(written, stager)
        if rig.is_global_zero:
            snapshot = to_host(payload["blob"], host_buffers(rig))  # no optimizer: DCP's
            payload, ready = {**payload, "blob": snapshot.tree}, snapshot.ready

    def needed() -> int:
        return rig.world_size * _local_bytes(shards) + payload_bytes({"modules": {}, "blob": payload["blob"]})

    def job() -> None:
        with uncommitted(target, needed):
            try:
                written()  # FileSystemWriter fsyncs every file; a failure on any rank is raised on every rank
                if rig.is_global_zero:
                    if ready is not None:
                        ready()
                    _finish(rig, out, payload, modules, optims, keep_last=keep_last, link=link)
            except BaseException:
                if rig.is_global_zero:
                    out.discard()
                raise

    return job


class _Output:
    """Where a sharded save's files go before its commit: a hidden temp directory next to a local
    ``target`` (renamed into place), or a version prefix under a ``target`` on object storage
    (committed by its ``meta.json``, :func:`remote.commit`), that DCP writes through fsspec."""

    def __init__(self, target: Path | CheckpointURL, made: str) -> None:
        self.target = target
        self.made = made  # the temp directory, or the version's name
        self.writer: Any = None
        if isinstance(target, CheckpointURL):
            from torchrig.checkpoint.dcp_upload import UploadingWriter

            self.writer = UploadingWriter(str(target / made))  # a plain str: DCP pickles it into .metadata

    @property
    def dcp_destination(self) -> dict[str, Any]:
        """How ``dcp.save``/``dcp.async_save`` are told where to write."""
        return {"storage_writer": self.writer} if self.writer is not None else {"checkpoint_id": Path(self.made)}

    def discard(self) -> None:
        """Remove what a save that failed before its commit wrote (rank zero)."""
        if isinstance(self.target, CheckpointURL):
            remote.abandon(self.target, self.made)
        else:
            discard(Path(self.made))

    def commit(self, describe: Callable[[Path, dict[str, Any], bytes], dict[str, Any]], **how: Any) -> None:
        """Rank zero, once every shard is written: ``state.pt`` and ``meta.json`` (``describe(folder,
        shard_files, dcp_metadata_bytes)`` writes the one and returns the other), then the commit:
        a local temp directory is renamed into place, on object storage ``state.pt`` is uploaded
        beside the shards and ``meta.json`` last."""
        if isinstance(self.target, CheckpointURL):
            with remote.staging() as staged:
                md = remote.uploaded(self.target, self.made, DCP_METADATA)
                meta = describe(staged, self.writer.files, md)
                remote.commit(staged, self.target, meta, version=self.made, **how)
            return
        tmp = Path(self.made)
        files = hash_existing(tmp, [p.name for p in tmp.iterdir()])  # DCP's files, on every rank's shared disk
        publish(tmp, self.target, describe(tmp, files, read_regular(tmp / DCP_METADATA)), **how)


#: Whether one DCP ``DefaultStager`` serves every background sharded save. Before torch 2.13 (seen
#: on 2.11) staging closes the stager's copier, and a second ``stage`` on it fails (``KeyError:
#: <class 'type'>``), so each save there gets a stager of its own.
STAGER_REUSABLE = TorchVersion(torch.__version__) >= "2.13"


def _then_close(written: Callable[[], Any], stager: Any) -> Callable[[], Any]:
    def wait_and_close() -> Any:
        try:
            return written()
        finally:
            stager.close()

    return wait_and_close


def _save_group(rig: Any) -> Any:
    """The process group (gloo, every rank) of background sharded saves, made at the first one
    (every rank calls ``rig.save``, so every rank makes it at the same point)."""
    saves = rig.background_saves
    if saves.group is None:
        saves.group = dist.new_group(backend="gloo")
    return saves.group


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
    out: _Output,
    payload: dict[str, Any],
    modules: dict[str, nn.Module],
    optims: dict[str, Any],
    *,
    keep_last: int | None,
    link: str | None,
) -> None:
    """Rank zero, once every shard is written: ``state.pt``, checksums, ``meta.json``, commit."""
    check_weights_only(payload["blob"])

    def describe(folder: Path, shard_files: dict[str, dict[str, Any]], dcp_metadata: bytes) -> dict[str, Any]:
        with FileSet(folder) as files:
            files.add(STATE_FILE, functools.partial(write_torch, obj=payload["blob"]))
            table = files.finish()
        table.update(shard_files)
        entries = dict(payload["entries"])
        entries.update({k: {"kind": "module", "type": qualname(m), "dcp": True} for k, m in modules.items()})
        entries.update({k: {"kind": "optimizer", "type": qualname(o), "dcp": True} for k, o in optims.items()})
        meta = base_meta(rig, entries, payload["blob"]["values"])
        md = parse_dcp_metadata(folder / DCP_METADATA, dcp_metadata, files=table)  # as loads read it
        counts = module_counts(modules.values())  # full sizes: a DTensor's numel is the whole tensor's
        meta.update(sharded=True, files=table, tensors=_count_tensors(md, list(modules)), **counts)
        return meta

    out.commit(describe, link=link, keep_last=keep_last)


def _count_tensors(md: Any, module_keys: list[str]) -> int:
    """How many tensors the modules' shards hold, from DCP's metadata ``md``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefixes = tuple(f"{k}." for k in module_keys)
    return sum(
        1 for k, v in md.state_dict_metadata.items() if k.startswith(prefixes) and isinstance(v, TensorStorageMetadata)
    )


def load(
    rig: Any,
    folder: Path,
    meta: dict[str, Any],
    state: dict[str, Any] | None,
    *,
    strict: bool,
    verify: bool,
    prepare: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load shards into the modules and optimizers of ``state`` in this process's layout
    (``prepare``: as :func:`torchrig.checkpoint.load` says)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if state is None:
        raise ValueError(
            f"{folder} is a sharded checkpoint: load it into objects (rig.load(path, {{'model': model, ...}})), "
            f"or make one file of it with `torchrig checkpoint consolidate {folder} OUT`"
        )
    entries = meta["entries"]
    check_entries(folder, entries, state, strict)
    with VerifiedReader(folder, meta, verify=verify) as reader:
        reader.path(STATE_FILE)  # its hash starts; checked with the metadata's
        md = _verified_metadata(reader, meta)
        blob = safe_torch_load(reader.path(STATE_FILE), map_location=rig.device)
    if prepare is not None:
        prepare(blob["values"])
        check_entries(folder, entries, state, strict)  # what prepare added
    modules, optims, rest = split(state)
    _compare(md, modules, strict)
    _check_before_dcp(entries, blob, modules, optims, rest, strict=strict)
    wanted = {k: o for k, o in optims.items() if k in entries}
    stateless, nested = _stateless_in(md, wanted), _nested_in(md, wanted)
    shards = dcp_state({k: m for k, m in modules.items() if k in entries}, wanted, stateless, nested)
    with refuse_code(folder):
        storage = checked_reader(folder, md, _shards_ready(folder, meta, verify=verify), checkpoint=_identity(meta))
        dcp.load(shards, storage_reader=storage, planner=safe_planner())
    for k, m in modules.items():
        if k in shards:
            set_model_state_dict(m, shards[k])
    restore_rank_buffers(rig, blob.get("rank_buffers"), {k: m for k, m in modules.items() if k in shards})
    for k, o in optims.items():
        if k in shards:
            options = _optimizer_options(k, nested | stateless)
            set_optimizer_state_dict(_owner(modules, o), o, shards[k], options=options)
    return apply_loaded(rig, entries, blob, {}, rest, strict=strict, device=rig.device)


def _identity(meta: dict[str, Any]) -> str:
    """What tells one committed checkpoint from another: a digest of its ``meta.json`` content
    (every file's SHA-256, the save's count)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


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

    from torchrig.pipelining import pipeline_of

    md = dcp_metadata.state_dict_metadata
    problems = []
    for key, module in modules.items():
        pipeline = pipeline_of(module)  # a pipeline stage: the other stages' tensors are not for it
        elsewhere = pipeline.elsewhere if pipeline is not None else frozenset()
        saved = {
            name[len(key) + 1 :]: torch.empty(v.size, device="meta")
            for name, v in md.items()
            if name.startswith(key + ".")
            and isinstance(v, TensorStorageMetadata)
            and name[len(key) + 1 :] not in elsewhere
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
    with refuse_code(folder):
        storage = checked_reader(folder, md, _shards_ready(folder, meta, verify=True))
        _load_state_dict(sd, storage_reader=storage, planner=safe_planner(keys=keys), no_dist=True)
    return {k: {n: t for n, t in sd.get(k, {}).items() if isinstance(t, torch.Tensor)} for k in keys}
