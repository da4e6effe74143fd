"""The model summary a fit prints when it starts (``Trainer(enable_model_summary=True)``, the default).

One row per top-level submodule (``module.named_children()``), plus one for parameters the
module holds itself: its type, trainable and frozen parameter counts, and its size in bytes as
the run holds the parameters (after ``rig.prepare``: ``bf16-true`` stores 2 bytes a parameter,
``32-true`` and the mixed precisions 4). The total row counts each parameter once (shared ones
too), so it equals ``sum(p.numel() for p in module.parameters())``. Under FSDP a parameter is a
``DTensor`` whose ``numel()`` is the full, unsharded count, so the table shows the whole model
on every layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = ["LayerSummary", "format_bytes", "summarize", "summary_table"]


@dataclass
class LayerSummary:
    """One row of the summary."""

    name: str
    type: str
    trainable: int
    frozen: int
    bytes: int

    @property
    def params(self) -> int:
        return self.trainable + self.frozen


def _count(params: Iterable[nn.Parameter]) -> tuple[int, int, int]:
    """Trainable and frozen element counts and bytes of ``params``, each parameter once."""
    trainable = frozen = size = 0
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()  # a DTensor's is the global count
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
        size += n * p.element_size()
    return trainable, frozen, size


def summarize(module: nn.Module, max_depth: int = 1) -> tuple[list[LayerSummary], LayerSummary]:
    """The rows (submodules down to ``max_depth`` levels, ``-1``: all, in definition order; then
    the module's own parameters if any) and the total."""
    rows = []
    for name, child in module.named_modules():
        depth = name.count(".") + 1
        if name and (max_depth == -1 or depth <= max_depth):
            rows.append(LayerSummary(name, type_name(child), *_count(child.parameters())))
    own = list(module.parameters(recurse=False))
    if own:
        rows.append(LayerSummary("(own parameters)", type_name(module), *_count(own)))
    total = LayerSummary("total", type_name(module), *_count(module.parameters()))
    return rows, total


def type_name(module: nn.Module) -> str:
    """The class name of ``module`` as its author wrote it (FSDP2's ``fully_shard`` swaps in a
    class ``FSDP<Name>`` deriving from ``(FSDPModule, <Name>)``)."""
    kind = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return kind.__name__
    while issubclass(kind, FSDPModule) and kind.__bases__[0] is FSDPModule and len(kind.__bases__) == 2:
        kind = kind.__bases__[1]
    return kind.__name__


def format_bytes(size: int) -> str:
    """``1.5 KB``, ``12.0 MB``... (powers of 1000, as the counts)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def summary_table(module: nn.Module, precision: str | None = None, max_depth: int = 1) -> str:
    """The summary of ``module`` as text (a rich table), ``precision`` named in the title; rows
    down to ``max_depth`` levels of submodules (:func:`summarize`)."""
    from rich.table import Table

    from torchrig.trainer.profiler import rendered

    rows, total = summarize(module, max_depth)
    where = f" in {precision}" if precision else ""
    table = Table(title=f"Model summary: {type_name(module)}{where}")
    for column in ("", "name", "type", "trainable", "frozen", "size"):
        table.add_column(column, justify="left" if column in ("name", "type") else "right")
    for i, row in enumerate(rows):
        table.add_row(str(i), row.name, row.type, f"{row.trainable:,}", f"{row.frozen:,}", format_bytes(row.bytes))
    table.add_row("", "total", "", f"{total.trainable:,}", f"{total.frozen:,}", format_bytes(total.bytes), style="bold")
    return rendered(table)
