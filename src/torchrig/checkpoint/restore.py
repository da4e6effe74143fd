"""Loaded state put into the user's objects: all of it or (on an error) none of it, RNG included."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from torchrig.checkpoint.compare import load_problems
from torchrig.checkpoint.entries import is_stateful, user_module
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.rank_buffers import restore_rank_buffers
from torchrig.checkpoint.rng import capture_rng, restore_rng


def update_values(state: dict[str, Any] | None, left: dict[str, Any]) -> dict[str, Any]:
    """Plain values named in ``state`` take their loaded value there (whole and sharded loads alike)."""
    for key, obj in (state or {}).items():
        if key in left and not is_stateful(obj):
            state[key] = left[key]  # type: ignore[index]  # state is not None here
    return left


def apply_loaded(
    rig: Any,
    entries: dict[str, dict[str, Any]],
    blob: dict[str, Any],
    tensors: dict[str, dict[str, torch.Tensor]],
    state: dict[str, Any] | None,
    *,
    strict: bool,
    device: torch.device,
) -> dict[str, Any]:
    """Fill the objects of ``state`` from ``blob`` (``state.pt``) and ``tensors`` (module weights;
    empty for a sharded checkpoint, whose modules DCP filled); returns what is left over.

    Every entry is checked first (:func:`~torchrig.checkpoint.compare.load_problems`); then the
    RNG states and the objects with ``state_dict`` are restored, each put back if a later one fails
    (torch's own ``load_state_dict`` checks less and can still fail); module weights go last.
    """
    wanted = state if state is not None else {}
    modules = {k: o for k, o in wanted.items() if isinstance(o, nn.Module) and k in entries}
    objects = {k: o for k, o in wanted.items() if k not in modules and k in entries and is_stateful(o)}
    problems = load_problems(entries, blob, tensors, modules, objects, strict=strict)
    if problems:
        raise CheckpointError("\n".join(problems))
    done: list[tuple[Any, Any]] = []
    rng_before = capture_rng(rig.device) if state is not None else None
    try:
        if state is not None:
            rngs = blob["rng"]
            restore_rng(rngs[rig.global_rank] if len(rngs) == rig.world_size else rngs[0], rig.device)
        for key, obj in objects.items():
            done.append((obj, snapshot(obj)))
            _load_object(key, obj, blob["objects"].pop(key), entries[key]["type"])
        for key, obj in modules.items():
            user_module(obj).load_state_dict({**tensors.pop(key), **blob["module_extras"].get(key, {})}, strict=strict)
        restore_rank_buffers(rig, blob.get("rank_buffers"), {k: user_module(o) for k, o in modules.items()})
    except BaseException:
        for obj, before in reversed(done):
            obj.load_state_dict(before)
        if rng_before is not None:
            restore_rng(rng_before, rig.device)
        raise
    return _left_over(blob, {k: sd for k, sd in tensors.items() if k not in modules}, device)


def _load_object(key: str, obj: Any, saved: Any, saved_type: str) -> None:
    try:
        obj.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(
            f"could not load checkpoint entry {key!r} (saved from a {saved_type}) into "
            f"the {type(obj).__name__} given: {err}; nothing was changed"
        ) from err


def _left_over(
    blob: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]], device: torch.device
) -> dict[str, Any]:
    """Plain values, unclaimed object states and module weights, the weights copied to ``device``
    (they are mapped from the file) with ties kept."""
    left: dict[str, Any] = dict(blob["values"])
    left.update(blob["objects"])
    copies: dict[int, torch.Tensor] = {}
    left.update(
        {k: {n: copies.setdefault(id(t), t.to(device, copy=True)) for n, t in sd.items()} for k, sd in tensors.items()}
    )
    return left


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
