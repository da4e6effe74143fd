"""Whether saved state fits the objects it is loaded into, said before anything changes: names and
shapes of module tensors, optimizer classes, parameter groups and state shapes, scheduler classes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrig.checkpoint.entries import qualname, user_module

_SHOW = 8


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


def compare_optimizer(key: str, saved_type: str, optimizer: torch.optim.Optimizer, own: str, saved: Any) -> str | None:
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


def load_problems(
    entries: dict[str, dict[str, Any]],
    blob: dict[str, Any],
    tensors: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, nn.Module],
    objects: dict[str, Any],
    *,
    strict: bool,
) -> list[str]:
    """Everything that would make loading into ``modules`` and ``objects`` fail, before any changes.

    Modules: entry kind, names and shapes (with ``strict=False`` mismatched tensors are dropped
    from ``tensors``). Objects with ``state_dict``: a saved state to load; optimizers and LR
    schedulers: the class they were saved from; optimizers: parameter groups and state shapes.
    """
    problems = []
    for key, obj in modules.items():
        if entries[key]["kind"] != "module":
            problems.append(f"checkpoint entry {key!r} holds a {entries[key]['type']}, not a module's weights")
            continue
        if key not in tensors:  # a sharded checkpoint: DCP compares its modules itself
            continue
        wrong, message = compare_module(key, user_module(obj), tensors[key])
        if message is not None and strict:
            problems.append(message)
        for name in wrong:
            tensors[key].pop(name)
    for key, obj in objects.items():
        if key not in blob["objects"]:
            problems.append(f"checkpoint entry {key!r} holds a {entries[key]['type']}, which has no state_dict")
            continue
        if isinstance(obj, torch.optim.Optimizer):
            message = compare_optimizer(key, entries[key]["type"], obj, qualname(obj), blob["objects"][key])
            if message is not None:
                problems.append(message)
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and qualname(obj) != entries[key]["type"]:
            problems.append(
                f"checkpoint entry {key!r} was saved from a {entries[key]['type']}, not the {qualname(obj)} given"
            )
    return problems
