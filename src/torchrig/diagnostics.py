"""Explanations for device and dtype mismatches raised inside a prepared module's forward."""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from torchrig.nested import apply_to_tensors

_MISMATCH = re.compile(
    r"Expected all tensors to be on the same device"
    r"|Input type \(.*\) and weight type \(.*\) should be the same"
    r"|Expected object of device type"
    r"|expected (?:both )?.*(?:same device|on the same device)"
    r"|found at least two devices"
    r"|is not on the expected device"
    r"|(?:on|at) the same device"
    r"|Placeholder storage has not been allocated on MPS device"
    r"|must share same datatype"
    r"|expected scalar type \w+ but found \w+"
    r"|expected m1 and m2 to have the same dtype"
    r"|mat1 and mat2 must have the same dtype"
    r"|expected mat1 and mat2 to have the same dtype"
    r"|should be the same|same dtype",
    re.IGNORECASE,
)
_SHOW = 4


class DeviceMismatchError(RuntimeError):
    """A device or dtype mismatch inside a prepared module, with an explanation of where and why."""


def is_mismatch(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and bool(_MISMATCH.search(str(err)))


def _where(t: torch.Tensor) -> str:
    return f"{t.device} {str(t.dtype).replace('torch.', '')}"


def _group(named: list[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for name, t in named:
        groups[_where(t)].append(name)
    return groups


def _fmt(groups: dict[str, list[str]]) -> str:
    lines = []
    for where, names in groups.items():
        shown = ", ".join(names[:_SHOW]) + (f", ... ({len(names)} in all)" if len(names) > _SHOW else "")
        lines.append(f"    on {where}: {shown}")
    return "\n".join(lines)


def _input_tensors(args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    found: list[tuple[str, torch.Tensor]] = []

    def visit(prefix: str, data: Any) -> None:
        if isinstance(data, torch.Tensor):
            found.append((prefix, data))
        elif isinstance(data, dict):
            for k, v in data.items():
                visit(f"{prefix}[{k!r}]", v)
        elif isinstance(data, (list, tuple)):
            for i, v in enumerate(data):
                visit(f"{prefix}[{i}]", v)
        else:
            apply_to_tensors(data, lambda t: found.append((prefix, t)))

    for i, a in enumerate(args):
        visit(f"input {i}", a)
    for k, v in kwargs.items():
        visit(f"input {k!r}", v)
    return found


def explain(err: BaseException, module: nn.Module, args: Any, kwargs: Any, device: torch.device) -> str | None:
    """A multi-line explanation of a mismatch error, or None when ``err`` is not one."""
    if not is_mismatch(err):
        return None
    state: list[tuple[str, torch.Tensor]] = [(f"parameter {n}", p) for n, p in module.named_parameters()]
    state += [(f"buffer {n}", b) for n, b in module.named_buffers()]
    inputs = _input_tensors(args, kwargs)
    off_state = [n for n, t in state if t.device != device]
    off_inputs = [n for n, t in inputs if t.device != device]
    dtypes = {t.dtype for _, t in state if t.is_floating_point()}
    in_dtypes = {t.dtype for _, t in inputs if t.is_floating_point()}
    fixes = []
    if off_state:
        fixes.append(
            f"{len(off_state)} parameter(s)/buffer(s) are not on {device} ({off_state[0]} ...): a "
            "submodule or tensor attribute created or moved after rig.prepare(). Create every "
            "submodule in __init__ before prepare, register tensors with register_buffer(), "
            "or call rig.to_device() on what you add later."
        )
    if off_inputs:
        fixes.append(
            f"{len(off_inputs)} input(s) are not on {device} ({off_inputs[0]} ...): the batch did "
            "not come from a prepared dataloader. Pass the loader through rig.prepare(), or move "
            "the batch with rig.to_device(batch)."
        )
    if not fixes and (len(dtypes) > 1 or (in_dtypes and dtypes and not in_dtypes <= dtypes)):
        fixes.append(
            "the inputs and weights have different dtypes: cast the input (x.to(weight.dtype)), "
            "or pick a precision that does it for you (precision='bf16-mixed' autocasts)."
        )
    if not fixes:
        fixes.append(
            f"every parameter, buffer and input is on {device}, so a tensor created inside "
            "forward() is elsewhere: create it with device=x.device (and dtype=x.dtype), or "
            "register it as a buffer in __init__."
        )
    return (
        f"{str(err).splitlines()[0]}\n"
        f"  torchrig expected everything on {device}. Where things are:\n"
        f"{_fmt(_group(state + inputs))}\n"
        "  Likely fix: " + "\n  Also: ".join(fixes)
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the line outside torchrig that led here (the user's
    ``trainer.fit(...)``), however deep in torchrig it is raised: Python 3.12's
    ``skip_file_prefixes``, for every Python torchrig supports."""
    frame = sys._getframe(1)
    level = 2  # the frame that called this function
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
