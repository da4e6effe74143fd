"""Moving nested batches between devices, preserving their types."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested dicts, lists, tuples, namedtuples and dataclasses.

    Other leaves are returned untouched, and every container keeps its type.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if is_container(data):
        return rebuild(data, lambda v: apply_to_tensors(v, fn))
    return data


def batch_sizes(data: Any) -> Iterator[int]:
    """The first dimension of every tensor in a nested batch, in order (1 for a 0-d tensor), as
    Lightning infers a batch's size: mappings' values, lists and tuples, dataclasses' fields."""
    if isinstance(data, torch.Tensor):
        yield data.shape[0] if data.dim() else 1
    elif is_container(data):
        if isinstance(data, Mapping):
            children: Any = data.values()
        elif isinstance(data, (list, tuple)):
            children = data
        else:
            children = [getattr(data, fl.name) for fl in dataclasses.fields(data)]
        for child in children:
            yield from batch_sizes(child)


def is_container(data: Any) -> bool:
    if isinstance(data, (Mapping, list, tuple)):
        return True
    return dataclasses.is_dataclass(data) and not isinstance(data, type)


def rebuild(data: Any, f: Callable[[Any], Any]) -> Any:
    """A mapping, list, tuple, namedtuple or dataclass with ``f`` applied to each child, type kept."""
    cls = type(data)
    if isinstance(data, Mapping):
        items = {k: f(v) for k, v in data.items()}
        return items if cls is dict else _rebuild_mapping(data, items)
    if isinstance(data, (list, tuple)):
        children = [f(v) for v in data]
        if cls is list:
            return children
        if cls is tuple:
            return tuple(children)
        return cls(*children) if hasattr(data, "_fields") else cls(children)  # namedtuple or subclass
    changes = {fl.name: f(getattr(data, fl.name)) for fl in dataclasses.fields(data) if fl.init}
    return dataclasses.replace(data, **changes)


def move_to_device(batch: Any, device: torch.device | str, *, non_blocking: bool | None = None) -> Any:
    """Move every tensor (and any object with ``.to()``) in ``batch`` to ``device``.

    Dicts, lists, tuples, namedtuples, dataclasses and mappings such as ``defaultdict`` keep
    their type; other leaves (strings, numbers, arrays) are returned untouched. Copies to an
    accelerator are ``non_blocking`` (pinned batches then overlap with compute), except to MPS
    where PyTorch does not make that safe, and never towards the CPU, where the host would read
    memory before the copy lands.

    Example:
        >>> import torch
        >>> move_to_device({"x": [torch.ones(1)], "n": 3}, "cpu")
        {'x': [tensor([1.])], 'n': 3}
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if non_blocking is None:
        non_blocking = device.type not in ("cpu", "mps")
    return move_batch(batch, device, non_blocking)


_LEAVES = (str, bytes, int, float, bool, complex, type(None))


def move_batch(data: Any, device: torch.device, nb: bool) -> Any:
    """:func:`move_to_device` with ``device`` and ``non_blocking`` already resolved (the
    prepared loaders call it for every batch)."""
    # Hot path (called for every batch): exact-type checks for the common containers first, no
    # closures, and a device comparison (4x cheaper than a no-op ``Tensor.to``).
    if isinstance(data, torch.Tensor):
        return data if data.device == device else data.to(device, non_blocking=nb)
    cls = type(data)
    if cls is dict:
        return {k: move_batch(v, device, nb) for k, v in data.items()}
    if cls is list:
        return [move_batch(v, device, nb) for v in data]
    if cls is tuple:
        return tuple([move_batch(v, device, nb) for v in data])
    if isinstance(data, _LEAVES):
        return data
    # An object's own ``.to()`` first, even a mapping's (a transformers ``BatchEncoding``): it knows
    # what it holds besides its items.
    move = getattr(data, "to", None)
    if callable(move):
        return move(device, non_blocking=nb) if _takes_non_blocking(cls) else move(device)
    if is_container(data):
        return rebuild(data, lambda v: move_batch(v, device, nb))
    return data


def _rebuild_mapping(data: Any, items: dict[Any, Any]) -> Any:
    """``data`` holding ``items``, with its type and attributes: a copy updated in place where the
    mapping can be copied (a ``defaultdict`` keeps its factory, a transformers ``BatchEncoding``
    its ``encodings``), else one built anew from the items."""
    if isinstance(data, dict):  # copy.copy copies a dict subclass's items and its attributes
        out = copy.copy(data)
    elif isinstance(data, MutableMapping) and callable(getattr(data, "copy", None)):
        out = data.copy()  # type: ignore[attr-defined]  # a UserDict's own copy keeps its attributes
    else:
        return type(data)(items)
    out.update(items)
    return out


_TAKES_NON_BLOCKING: dict[type, bool] = {}


def _takes_non_blocking(cls: type) -> bool:
    """Whether ``cls.to`` accepts ``non_blocking=`` (cached per type: ``inspect`` is slow)."""
    known = _TAKES_NON_BLOCKING.get(cls)
    if known is None:
        try:
            params = inspect.signature(cls.to).parameters  # type: ignore[attr-defined]
            known = "non_blocking" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError, AttributeError):
            known = False
        _TAKES_NON_BLOCKING[cls] = known
    return known
