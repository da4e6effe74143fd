"""The save-time check that every non-tensor part of a checkpoint is plain data that
``torch.load(weights_only=True)`` reads back: refused before any file is written, by key and why."""

from __future__ import annotations

import copy
import io
import pickletools
import re
from typing import Any

import torch

from torchrig.checkpoint.reading import unsafe_globals


class _SelfReferenceError(TypeError):
    pass


def _skeleton(obj: Any, where: str, inside: frozenset[int] = frozenset()) -> Any:
    """``obj`` with every tensor replaced by an empty one: enough to see which classes it pickles.

    A list or dict that contains itself is a :class:`TypeError` naming where (pickle would recurse).
    """
    if isinstance(obj, torch.Tensor):  # a quantized tensor cannot be made empty without its quantizer: kept
        return obj if obj.is_quantized else torch.empty(0, dtype=obj.dtype)
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in inside:
            raise _SelfReferenceError(
                f"{where} is a {type(obj).__name__} that contains itself; a checkpoint cannot hold a list or "
                "dict that refers to itself"
            )
        inside = inside | {id(obj)}
    if isinstance(obj, dict):
        out = {k: _skeleton(v, f"{where}[{k!r}]", inside) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        same = copy.copy(obj)  # a dict subclass (OrderedDict, defaultdict) keeps its class for the check
        same.clear()
        same.update(out)
        return same
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_skeleton(v, f"{where}[{i}]", inside) for i, v in enumerate(obj))
    return obj


_OPCODES_IN_WORDS = {"LONG4": "an int of more than 255 bytes (pickle opcode LONG4)"}


def _why_not_saved(err: BaseException) -> str:
    """What a failed save-and-reload of one value says, in words."""
    if isinstance(err, RecursionError):
        return "it nests too deeply for pickle"
    found = re.search(r"Unsupported operand (\d+)", str(err))
    op = next((o.name for o in pickletools.opcodes if found and o.code == chr(int(found[1]))), None)
    if op is not None:
        what = _OPCODES_IN_WORDS.get(op, f"the pickle opcode {op}")
        return f"weights_only loading cannot read {what} back"
    if "Can't pickle" in str(err):  # a lambda, a local class: PicklingError or AttributeError
        return f"pickle cannot store it ({err}); functions and local classes cannot be saved"
    return f"{type(err).__name__}: {err}"


def check_weights_only(blob: dict[str, Any]) -> None:
    """Refuse, at save time and before any file is written, state that ``weights_only`` loading
    could not read back: a :class:`TypeError` naming the key (``state['step']``) and why."""
    parts = [(f"state[{k!r}]", v) for k, v in blob["values"].items()]
    parts += [(f"state[{k!r}].state_dict()", v) for k, v in blob["objects"].items()]
    parts += [(f"the extra state of state[{k!r}]", v) for k, v in blob["module_extras"].items() if v]
    for where, value in parts:
        buf = io.BytesIO()
        try:
            torch.save(_skeleton(value, where), buf)
            buf.seek(0)
            bad = unsafe_globals(buf)
        except _SelfReferenceError as err:
            raise TypeError(str(err)) from None
        except Exception as err:  # pickling, torch's serializer, the weights_only reader
            raise TypeError(f"{where} cannot be saved in a checkpoint: {_why_not_saved(err)}") from None
        if bad:
            raise TypeError(
                f"{where} holds Python objects that cannot be loaded safely: {', '.join(bad)}. "
                "A checkpoint stores tensors, numbers, strings, lists, tuples and dicts only (loading never "
                "unpickles arbitrary objects); convert these values to plain types, or give the object "
                "state_dict()/load_state_dict() that return plain types"
            )
