"""What a checkpoint holds: module tensors for safetensors, other state, RNG, and mismatch reports."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

from torchrig.checkpoint.files import CheckpointError

ALIASES_KEY = "torchrig.aliases"
_SHOW = 8


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful``: anything with callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def unwrap_module(module: nn.Module) -> nn.Module:
    """The user's module inside a ``RigModule`` (its state-dict keys are the user's keys)."""
    inner = getattr(module, "module", None)
    from torchrig.wrappers import RigModule

    return inner if isinstance(module, RigModule) and isinstance(inner, nn.Module) else module


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


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write ``tensors`` (tied ones once) to ``path``, fsynced; returns the file's SHA-256."""
    from torchrig.checkpoint.files import durable, sha256_file

    out, metadata = for_safetensors(tensors)
    safetensors.torch.save_file(out, str(path), metadata=metadata)  # straight from tensor memory
    # The hash re-reads the file from the page cache while the disk flushes it.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-fsync") as pool:
        flushed = pool.submit(durable, path)
        digest = sha256_file(path)
        flushed.result()
    return digest


def from_safetensors_file(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a file written by :func:`write_safetensors` on ``device``, tied tensors re-tied."""
    with safetensors.safe_open(str(path), framework="pt", device=str(device)) as f:  # type: ignore[no-untyped-call]
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        meta = f.metadata() or {}
    for alias, name in json.loads(meta.get(ALIASES_KEY, "{}")).items():
        tensors[alias] = tensors[name]
    return tensors


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
    if not isinstance(key, str) or not key or not all(c.isalnum() or c in "_-." for c in key) or key[0] == ".":
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
