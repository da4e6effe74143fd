"""Moving nested batches between devices, preserving their types."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested dicts, lists, tuples, namedtuples and dataclasses.

    Other leaves are returned untouched, and every container keeps its type.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (str, bytes, int, float, bool, type(None))):
        return data
    cls = type(data)
    if isinstance(data, Mapping):
        items = {k: apply_to_tensors(v, fn) for k, v in data.items()}
        if cls is dict:
            return items
        return _rebuild_mapping(data, items)
    if isinstance(data, tuple):
        moved = [apply_to_tensors(v, fn) for v in data]
        return cls(*moved) if hasattr(data, "_fields") else (tuple(moved) if cls is tuple else cls(moved))
    if isinstance(data, list):
        moved_list = [apply_to_tensors(v, fn) for v in data]
        return moved_list if cls is list else cls(moved_list)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {f.name: apply_to_tensors(getattr(data, f.name), fn) for f in dataclasses.fields(data) if f.init}
        return dataclasses.replace(data, **changes)
    return data


def move_to_device(batch: Any, device: torch.device | str, *, non_blocking: bool | None = None) -> Any:
    """Move every tensor (and any object with ``.to()``) in ``batch`` to ``device``.

    Dicts, lists, tuples, namedtuples and dataclasses keep their type; other leaves are untouched.
    Copies are ``non_blocking`` from pinned memory to an accelerator (never to MPS, where PyTorch
    does not make that safe).

    Example:
        >>> import torch
        >>> move_to_device({"x": [torch.ones(1)], "n": 3}, "cpu")
        {'x': [tensor([1.])], 'n': 3}
    """
    device = torch.device(device)
    if non_blocking is None:
        non_blocking = device.type not in ("cpu", "mps")
    nb = non_blocking

    def to(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        return t.to(device, non_blocking=nb and t.is_pinned())

    return _move(batch, device, to, nb)


def _move(data: Any, device: torch.device, to: Callable[[torch.Tensor], Any], nb: bool) -> Any:
    # The common cases (a tensor, a dict/list/tuple of tensors) take the fast path; everything
    # else goes through ``apply_to_tensors`` plus the ``.to()`` duck-typing below.
    if isinstance(data, torch.Tensor):
        return to(data)
    cls = type(data)
    if cls is dict:
        return {k: _move(v, device, to, nb) for k, v in data.items()}
    if cls is list:
        return [_move(v, device, to, nb) for v in data]
    if cls is tuple:
        return tuple(_move(v, device, to, nb) for v in data)
    if isinstance(data, (str, bytes, int, float, bool, type(None))):
        return data
    if isinstance(data, (Mapping, list, tuple)) or dataclasses.is_dataclass(data):
        return _structured(data, device, to, nb)
    move = getattr(data, "to", None)
    if callable(move):
        return move(device, non_blocking=nb) if _takes_non_blocking(move) else move(device)
    return data


def _structured(data: Any, device: torch.device, to: Callable[[torch.Tensor], Any], nb: bool) -> Any:
    cls = type(data)
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {k: _move(v, device, to, nb) for k, v in data.items()})
    if isinstance(data, tuple):
        moved = [_move(v, device, to, nb) for v in data]
        return cls(*moved) if hasattr(data, "_fields") else cls(moved)
    if isinstance(data, list):
        return cls([_move(v, device, to, nb) for v in data])
    changes = {f.name: _move(getattr(data, f.name), device, to, nb) for f in dataclasses.fields(data) if f.init}
    return dataclasses.replace(data, **changes)


def _rebuild_mapping(data: Any, items: dict[Any, Any]) -> Any:
    try:
        return type(data)(items)
    except TypeError:  # e.g. defaultdict, whose first argument is the factory
        out = data.copy()
        out.update(items)
        return out


def _takes_non_blocking(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        return "non_blocking" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
