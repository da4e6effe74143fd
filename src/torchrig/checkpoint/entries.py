"""What each entry of a saved ``state`` is (module, object with ``state_dict``, plain value) and
what is collected from it on every rank, plus the description that goes into ``meta.json``."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.meta import FORMAT, FORMAT_VERSION, plain_key
from torchrig.checkpoint.rank_buffers import every_rank_buffers
from torchrig.checkpoint.rng import capture_rng
from torchrig.checkpoint.tensors import split_module_state
from torchrig.speedups import unwrap_compiled
from torchrig.wrappers import RigOptimizer, as_prepared


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful``: anything with callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def user_module(module: nn.Module) -> nn.Module:
    """The module the user built, inside a ``RigModule`` and/or the ``OptimizedModule`` of a
    ``torch.compile(module)``: its state-dict keys are the model's own, compiled or not (no
    ``_orig_mod.``), so a checkpoint loads into the model compiled or not.

    Not :func:`torchrig.strategies.ddp.unwrap_module`, which stops at what the strategy wrapped
    (the module inside ``DistributedDataParallel``, compiled or not).
    """
    prepared = as_prepared(module)
    if prepared is not None and isinstance(prepared.module, nn.Module):
        module = prepared.module
    return unwrap_compiled(module)[0]


def qualname(obj: Any) -> str:
    """``module.Class`` of what ``obj`` is for the user: the optimizer inside a ``RigOptimizer``,
    the user's module inside its wrappers. ``meta.json`` records it for every entry."""
    if isinstance(obj, RigOptimizer):
        obj = obj.optimizer
    return class_name(type(user_module(obj)) if isinstance(obj, nn.Module) else type(obj))


def class_name(cls: type) -> str:
    """``module.Class``, as ``meta.json`` names the class of an entry."""
    return f"{cls.__module__}.{cls.__qualname__}"


def check_key(key: Any) -> str:
    """State keys become file names, so they are plain names."""
    if not plain_key(key):
        raise ValueError(
            f"state key {key!r} cannot name a checkpoint entry; use letters, digits, '_', '-' or '.' "
            "(for example 'model', 'optimizer', 'step')"
        )
    return key


def check_entries(folder: Any, entries: dict[str, Any], state: dict[str, Any] | None, strict: bool) -> None:
    """Refuse (``strict``) a ``state`` naming entries the checkpoint does not have."""
    missing = [k for k in state or {} if k not in entries]
    if missing and strict:
        raise CheckpointError(
            f"the checkpoint {folder} has no entries {missing}; it has {sorted(entries)} "
            "(pass strict=False to load only what is there)"
        )


def summary_values(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able plain values (step, epoch, metrics) for ``meta.json`` and ``inspect``."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
    return out


def collect(rig: Any, state: dict[str, Any], sharded_modules: dict[str, nn.Module] | None = None) -> dict[str, Any]:
    """Everything to write, taken on every rank (state-dict calls may be collectives).
    ``sharded_modules``: the modules DCP saves (not in ``state``), whose buffers that differ from
    rank to rank are kept per rank like those of the modules of ``state``."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    extras: dict[str, dict[str, Any]] = {}
    objects: dict[str, Any] = {}
    values: dict[str, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    counted: dict[str, nn.Module] = {}
    for key, obj in state.items():
        check_key(key)
        if isinstance(obj, nn.Module):
            sd = rig.strategy.module_state_dict(user_module(obj))
            modules[key], extras[key] = split_module_state(sd)
            entries[key] = {"kind": "module", "type": qualname(obj), "file": f"{key}.safetensors"}
            counted[key] = user_module(obj)
        elif is_stateful(obj):
            objects[key] = obj.state_dict()
            entries[key] = {"kind": "state", "type": qualname(obj)}
        else:
            values[key] = obj
            entries[key] = {"kind": "value", "type": qualname(obj)}
    blob = {"objects": objects, "values": values, "module_extras": extras, "rng": every_rank_rng(rig)}
    blob["rank_buffers"] = every_rank_buffers(rig, {**counted, **(sharded_modules or {})})
    return {"modules": modules, "blob": blob, "entries": entries, "counts": module_counts(counted.values())}


def every_rank_rng(rig: Any) -> list[Any]:
    """The RNG states of every rank (a collective when there are several), rank by rank."""
    rng = capture_rng(rig.device)
    if not (rig.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [rng]
    ranks: list[Any] = [None] * rig.world_size
    torch.distributed.all_gather_object(ranks, rng)
    return ranks


def base_meta(rig: Any, entries: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """What ``meta.json`` says of every checkpoint, whole or sharded (the files table is added by each)."""
    from torchrig import __version__  # set once the package's own imports (this module among them) are done

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
