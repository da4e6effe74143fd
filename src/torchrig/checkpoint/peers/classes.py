"""The optimizer and LR-scheduler class a peer's state dict was saved from: given by the user, or
inferred from the fields it holds."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from typing import Any

import torch
from torch.optim import lr_scheduler

from torchrig.checkpoint.entries import class_name
from torchrig.checkpoint.errors import CheckpointError


def _given_class(given: str, base: type, flag: str) -> str:
    module, _, attr = given.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except ImportError as err:
        raise ValueError(f"{flag} {given!r}: cannot import {module} ({err})") from None
    except AttributeError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{flag} {given!r} is not a {class_name(base)} class; give one such as {_example(base)}")
    return class_name(cls)


def _example(base: type) -> str:
    return "torch.optim.AdamW" if base is torch.optim.Optimizer else "torch.optim.lr_scheduler.StepLR"


def optimizer_class(sd: Any, given: str | None, where: str) -> tuple[str, str]:
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    if not (
        isinstance(groups, list)
        and groups
        and isinstance(sd.get("state"), dict)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise CheckpointError(f"{where} is not an optimizer state dict (it needs 'state' and 'param_groups')")
    if given is not None:
        return _given_class(given, torch.optim.Optimizer, "--optimizer"), "as --optimizer names it"
    saved = groups[0]
    keys = frozenset(k for k in saved if k not in ("params", "initial_lr"))
    found = {name: d for name, d in _optimizer_defaults() if frozenset(d) == keys}
    if len(found) > 1:  # Adam and AdamW: the same fields, told apart by a flag's value
        flags = [k for k in keys if all(isinstance(d[k], bool) for d in found.values())]
        flags = [k for k in flags if len({d[k] for d in found.values()}) > 1]
        found = {n: d for n, d in found.items() if all(d[k] == saved.get(k) for k in flags)}
    if len(found) != 1:
        which = f"it could be {' or '.join(sorted(found))}" if found else "no torch.optim class has these fields"
        raise ValueError(
            f"cannot tell the class of {where} from its parameter-group fields ({', '.join(sorted(keys))}): {which}; "
            "name it with --optimizer, e.g. --optimizer torch.optim.AdamW"
        )
    return next(iter(found)), "inferred from its parameter-group fields; --optimizer names another"


@functools.cache
def _optimizer_defaults() -> tuple[tuple[str, dict[str, Any]], ...]:
    """The parameter-group fields of each torch optimizer made with its defaults."""
    out = []
    for name in torch.optim.__all__:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                make: Any = cls  # each with its own signature; the defaults are what is wanted
                group = make([torch.zeros(2, 2, requires_grad=True)]).param_groups[0]
        except Exception:  # an optimizer that needs arguments: name it with --optimizer
            continue
        out.append((class_name(cls), {k: v for k, v in group.items() if k != "params"}))
    return tuple(out)


def scheduler_class(sd: Any, given: str | None, where: str) -> tuple[str, str]:
    if not isinstance(sd, dict):
        raise CheckpointError(f"{where} is a {type(sd).__name__}, not an LR scheduler state dict")
    if given is not None:
        return _given_class(given, lr_scheduler.LRScheduler, "--scheduler"), "as --scheduler names it"
    own = frozenset(map(str, sd)) - _scheduler_base_fields()
    found = []
    for name in dir(lr_scheduler):
        cls = getattr(lr_scheduler, name)
        if name.startswith("_") or not isinstance(cls, type) or not issubclass(cls, lr_scheduler.LRScheduler):
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        args = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if args - {"self", "optimizer", "last_epoch", "verbose"} == own:
            found.append(class_name(cls))
    if len(found) != 1:
        which = f"it could be {' or '.join(found)}" if found else "no torch.optim.lr_scheduler class has these fields"
        raise ValueError(
            f"cannot tell the class of {where} from its fields ({', '.join(sorted(own))}): {which}; name it with "
            "--scheduler, e.g. --scheduler torch.optim.lr_scheduler.StepLR"
        )
    return found[0], "inferred from its fields; --scheduler names another"


@functools.cache
def _scheduler_base_fields() -> frozenset[str]:
    """The fields every torch LR scheduler's state has (those of a StepLR but its own two)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return frozenset(lr_scheduler.StepLR(optimizer, 1).state_dict()) - {"step_size", "gamma"}
