"""What a checkpoint holds: module tensors for safetensors, other state, RNG, and mismatch reports."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

from torchrig.checkpoint.files import CheckpointError, open_regular, plain_key

ALIASES_KEY = "torchrig.aliases"
SHARD_BYTES = 256 << 20  # safetensors files are cut at about this size
EXTRACT_BYTES = 1 << 20  # tensors of the other state this large go to safetensors files
_SHOW = 8


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful``: anything with callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def unwrap_module(module: nn.Module) -> nn.Module:
    """The user's module inside a ``RigModule`` and/or the ``OptimizedModule`` of a
    ``torch.compile(module)``: its state-dict keys are the model's own, compiled or not (no
    ``_orig_mod.``), so a checkpoint loads into the model compiled or not."""
    from torchrig.speedups import unwrap_compiled
    from torchrig.wrappers import RigModule

    inner = getattr(module, "module", None)
    if isinstance(module, RigModule) and isinstance(inner, nn.Module):
        module = inner
    return unwrap_compiled(module)[0]


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


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (ready for safetensors) to ``path``, fsynced; returns the file's SHA-256."""
    from torchrig.checkpoint.files import durable, follow_umask, sha256_file

    safetensors.torch.save_file(tensors, str(path), metadata=metadata)  # straight from tensor memory
    follow_umask(path)
    # The hash reads the file back from the page cache while the disk flushes it: no extra copy.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-fsync") as pool:
        flushed = pool.submit(durable, path)
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

    For weights that ``load_state_dict`` copies into parameters right after the checksums
    matched; tensors that are kept go through :func:`read_safetensors_once`.
    """
    with safetensors.safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        return tensors, f.metadata() or {}


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors_once(
    path: Path, hashing: bool
) -> tuple[tuple[dict[str, torch.Tensor], dict[str, str]], str | None]:
    """Tensors and metadata of a safetensors file read once, and the SHA-256 of the bytes read.

    Each tensor's bytes are read straight into its own memory (one copy, like ``torch.load``)
    and hashed there, so what is verified is exactly what is returned; nothing is mapped from
    the file afterwards. The header is checked against the file size before anything is
    allocated. Dtypes this reader does not list go through ``safetensors.torch.load``.
    """
    digest = hashlib.sha256() if hashing else None
    with open_regular(path) as f:  # a regular file, never a link, FIFO or device; read up to its size only
        size = os.fstat(f.fileno()).st_size
        head = _read_exact(f, 8)
        n = int.from_bytes(head, "little")
        if not 2 <= n <= size - 8:
            raise ValueError(f"header length {n} does not fit in the {size}-byte file")
        raw = _read_exact(f, n)
        header = json.loads(raw)
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, dict) for v in header.values()):
            raise ValueError("the header is not a safetensors header")
        if any(info.get("dtype") not in _ST_DTYPES for info in header.values()):
            data = head + raw + _read_exact(f, size - 8 - n)
            return (safetensors.torch.load(data), metadata), hashlib.sha256(data).hexdigest() if hashing else None
        if digest is not None:
            digest.update(head)
            digest.update(raw)
        tensors, pos = {}, 0
        for (begin, end), name, info in sorted((tuple(v["data_offsets"]), k, v) for k, v in header.items()):
            dtype, shape = _ST_DTYPES[info["dtype"]], [int(d) for d in info["shape"]]
            if begin != pos or end - begin != math.prod(shape) * dtype.itemsize or end > size - 8 - n:
                raise ValueError(f"tensor {name!r} has data_offsets {[begin, end]}, which do not fit the file")
            t = torch.empty(shape, dtype=dtype)
            view = t.reshape(-1).view(torch.uint8).numpy().data  # the tensor's own bytes, writable
            _readinto_exact(f, view)
            if digest is not None:
                digest.update(view)  # releases the GIL: other files are read and hashed meanwhile
            tensors[name], pos = t, end
        if pos != size - 8 - n:
            raise ValueError(f"{size - 8 - n - pos} bytes after the last tensor")
    return (tensors, metadata), None if digest is None else digest.hexdigest()


def _read_exact(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"file ends early: wanted {n} bytes, got {len(data)}")
    return bytes(data)


def _readinto_exact(f: Any, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"file ends early: {view.nbytes - done} bytes of a tensor missing")
        done += got


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


# -- mismatch reports ----------------------------------------------------------------------
def _fmt(names: list[str], shapes: dict[str, Any]) -> str:
    shown = ", ".join(f"{n} {tuple(shapes[n])}" for n in names[:_SHOW])
    return shown + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def compare_module(
    key: str, module: nn.Module | dict[str, torch.Tensor], saved: dict[str, torch.Tensor]
) -> tuple[list[str], str | None]:
    """Names whose shapes differ, and a message listing every missing/unexpected/mismatched entry.

    ``module`` is the module to load into, or its state dict (under FSDP, with the full shapes).
    """
    sd = module if isinstance(module, dict) else module.state_dict()
    own = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    missing = [k for k in own if k not in saved]
    unexpected = sorted(k for k in saved if k not in own)
    wrong = [k for k in own if k in saved and tuple(own[k].shape) != tuple(saved[k].shape)]
    if not (missing or unexpected or wrong):
        return [], None
    what = "its module" if isinstance(module, dict) else f"the module {type(module).__name__}"
    lines = [f"checkpoint entry {key!r} does not match {what}:"]
    if missing:
        lines.append(f"  missing from the checkpoint ({len(missing)}): {_fmt(missing, {k: own[k].shape for k in own})}")
    if unexpected:
        shapes = {k: saved[k].shape for k in saved}
        lines.append(f"  in the checkpoint but not in the module ({len(unexpected)}): {_fmt(unexpected, shapes)}")
    for k in wrong[:_SHOW]:
        lines.append(f"  shape mismatch for {k}: checkpoint {tuple(saved[k].shape)}, module {tuple(own[k].shape)}")
    if len(wrong) > _SHOW:
        lines.append(f"  ... and {len(wrong) - _SHOW} more shape mismatches")
    if missing and unexpected and not (set(own) & set(saved)):
        lines.append("  no name in common: this checkpoint was saved from a different model")
    lines.append("  (load with strict=False to load only the entries that match)")
    return wrong, "\n".join(lines)


# Torch optimizers whose per-parameter state is not element-wise (factored or flattened moments).
_NOT_ELEMENTWISE = {"torch.optim.lbfgs.LBFGS", "torch.optim._adafactor.Adafactor"}


def compare_optimizer(
    key: str, saved_type: str, optimizer: torch.optim.Optimizer, own: str, saved: Any
) -> str | None:
    """Why ``saved`` (the state dict of an optimizer of class ``saved_type``) cannot be loaded into
    ``optimizer`` (of class ``own``), or ``None``: the class, the parameter groups and the shape of
    every state tensor are checked, where torch's ``load_state_dict`` checks only group sizes."""
    head = f"checkpoint entry {key!r} does not match the {own.rsplit('.', 1)[-1]} given"
    if saved_type != own:
        return f"{head}: it was saved from a {saved_type}, not a {own}; pass the optimizer it was saved from"
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    states = saved.get("state") if isinstance(saved, dict) else None
    if not (
        isinstance(groups, list)
        and isinstance(states, dict)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and all(isinstance(i, int) for g in groups for i in g["params"])
    ):
        return f"{head}: the checkpoint holds no optimizer state dict (no 'state' and 'param_groups')"
    if len(groups) != len(optimizer.param_groups):
        n = len(optimizer.param_groups)
        return f"{head}: {len(groups)} parameter groups in the checkpoint, {n} in the optimizer"
    lines = [
        f"  parameter group {i}: {len(g['params'])} parameters in the checkpoint, {n} in the optimizer"
        for i, (g, n) in enumerate(zip(groups, [len(g["params"]) for g in optimizer.param_groups], strict=True))
        if len(g["params"]) != n
    ]
    if lines:
        return "\n".join([f"{head}:", *lines])
    params = dict(
        zip(
            [i for g in groups for i in g["params"]],
            [p for g in optimizer.param_groups for p in g["params"]],
            strict=True,
        )
    )
    for i, values in states.items():
        param = params.get(i)
        if param is None or not isinstance(values, dict):
            continue  # torch keeps state of no parameter as it is
        live = optimizer.state.get(param, {})
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            mine = live.get(name)
            if isinstance(mine, torch.Tensor):
                want = tuple(mine.shape)  # the optimizer's own state says what shape it keeps
            elif own.startswith("torch.optim.") and own not in _NOT_ELEMENTWISE:
                want = tuple(param.shape)  # torch's element-wise optimizers keep moments of the parameter's shape
            else:
                continue
            if tuple(value.shape) != want:
                lines.append(f"  state {name!r} of parameter {i}: checkpoint {tuple(value.shape)}, optimizer {want}")
    more = [f"  ... and {len(lines) - _SHOW} more"] if len(lines) > _SHOW else []
    return "\n".join([f"{head}:", *lines[:_SHOW], *more]) if lines else None


# -- RNG ------------------------------------------------------------------------------------
def capture_rng(device: torch.device) -> dict[str, Any]:
    """Python, NumPy, torch CPU and every device of ``device.type``, as weights_only-safe data."""
    np_state: Any = np.random.get_state()  # the legacy tuple form
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    mod = _device_module(device)
    if mod is not None:
        rng["device_type"] = device.type
        rng["device"] = [s.cpu() for s in mod.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_tuple(rng["python"]))
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(rng["torch"].cpu())
    mod = _device_module(device)
    if mod is not None and rng.get("device_type") == device.type:
        states = rng["device"]
        if len(states) == mod.device_count():
            mod.set_rng_state_all(states)
        else:  # a different number of devices: this process's device gets the first saved state
            mod.set_rng_state(states[0], device.index)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _device_module(device: torch.device) -> Any:
    if device.type in ("cpu", "meta"):
        return None
    try:
        mod = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError):
        return None
    return mod if hasattr(mod, "get_rng_state_all") and hasattr(mod, "set_rng_state_all") else None


def check_key(key: Any) -> str:
    """State keys become file names, so they are plain names."""
    if not plain_key(key):
        raise ValueError(
            f"state key {key!r} cannot name a checkpoint entry; use letters, digits, '_', '-' or '.' "
            "(for example 'model', 'optimizer', 'step')"
        )
    return key


def summary_values(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able plain values (step, epoch, metrics) for ``meta.json`` and ``inspect``."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
    return out


def raise_if(message: str | None) -> None:
    if message is not None:
        raise CheckpointError(message)
