"""``MetricBuffer``: logged rows whose tensors stay on their device until a flush reads them all at once,
and :func:`format_floats`, the text a CSV file shows for them."""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import torch

from torchrig.trainer.metrics import Snapshot

#: One written row: ``(step, epoch, {name: value})``.
Row = tuple[int, "int | None", dict[str, float]]


class MetricBuffer:
    """Rows of logged metrics whose tensor values stay on their device until :meth:`drain`.

    :meth:`add` keeps a :class:`~torchrig.trainer.metrics.Snapshot` as it is (the Trainer's
    rows: scalars checked when logged, nothing changes them), so buffering a step costs one
    list append. Any other dict is checked and its tensors copied (they may be changed in place
    later: a parameter, a running sum). :meth:`drain` reads every buffered value at once: CPU
    tensors directly, the others with one transfer per device and dtype. :meth:`drain_text`
    gives the CSV text column by column.

    Example:
        >>> buf = MetricBuffer()
        >>> buf.add({"loss": torch.tensor(0.5)}, step=1, epoch=0)
        1
        >>> buf.drain()
        [(1, 0, {'loss': 0.5})]
    """

    def __init__(self) -> None:
        #: The buffered rows, ``(step, epoch, values, name left out)``: values map names to scalar
        #: tensors or numbers. A caller on a hot path may append a Snapshot row here itself, as
        #: :meth:`add` would; the list is replaced by a new one at each drain.
        self.rows: list[tuple[int, int | None, dict[str, Any], str | None]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self, metrics: dict[str, float | torch.Tensor], *, step: int, epoch: int | None, skip: str | None = None
    ) -> int:
        """Buffer one row (without the item named ``skip``); returns how many rows are buffered. No host sync."""
        if type(metrics) is Snapshot:
            self.rows.append((step, epoch, metrics, skip))
            return len(self.rows)
        row: dict[str, Any] = {}
        for name, value in metrics.items():
            if name == skip:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"logged metric {name!r} has shape {tuple(value.shape)}; loggers take scalars "
                        "(log a reduction such as value.mean())"
                    )
                row[name] = value.detach().reshape(()).clone()  # the value now, not after an in-place change
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                row[name] = float(value)
            else:
                raise TypeError(f"logged metric {name!r} is a {type(value).__name__}; log a number or a scalar tensor")
        self.rows.append((int(step), epoch, row, None))
        return len(self.rows)

    def drain(self) -> list[Row]:
        """Every buffered row with its values as floats (exact: a float32 value is the float it
        holds); empties the buffer."""
        rows, self.rows = self.rows, []
        floats = iter(_floats([v for *_, values, skip in rows for k, v in values.items() if k != skip]))
        return [
            (int(step), epoch, {k: next(floats) for k in values if k != skip}) for step, epoch, values, skip in rows
        ]

    def drain_text(self) -> tuple[list[str], list[str], dict[str, list[str]]]:
        """Every buffered row as CSV cell text, column by column; empties the buffer.

        Returns the steps, the epochs (empty where none) and, per metric name in the order first
        logged, each row's value as :func:`format_floats` writes it (empty where the row has
        none). Every value is read as :meth:`drain` reads it and formatted in one vectorized
        call, with no per-row dict.

        Example:
            >>> buf = MetricBuffer()
            >>> _ = buf.add({"loss": torch.tensor(0.5)}, step=1, epoch=0)
            >>> _ = buf.add({"acc": 0.25}, step=2, epoch=None)
            >>> buf.drain_text()
            (['1', '2'], ['0', ''], {'loss': ['0.5', ''], 'acc': ['', '0.25']})
        """
        rows, self.rows = self.rows, []
        steps = [str(row[0]) for row in rows]
        epochs = ["" if row[1] is None else str(row[1]) for row in rows]
        skipped = {row[3] for row in rows}
        cells: dict[str, list[Any]] = {}  # name -> its value in each row, None where it has none
        for name in dict.fromkeys(chain.from_iterable(row[2] for row in rows)):
            if name in skipped:
                column = [None if skip == name else values.get(name) for _, _, values, skip in rows]
                if all(v is None for v in column):
                    continue  # only ever a skipped name
            else:
                column = [values.get(name) for _, _, values, _ in rows]
            cells[name] = column
        text = iter(format_floats(_floats([v for column in cells.values() for v in column if v is not None])))
        columns = {name: ["" if v is None else next(text) for v in column] for name, column in cells.items()}
        return steps, epochs, columns


def _floats(values: list[Any]) -> list[float]:
    """Scalar tensors and numbers as floats, in order; every tensor read by one :func:`_read`."""
    tensor = torch.Tensor
    read = iter(_read([v for v in values if isinstance(v, tensor)]))
    return [next(read) if isinstance(v, tensor) else float(v) for v in values]


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of scalar ``tensors`` as floats, in order: a CPU tensor read directly, the
    others stacked per device and dtype, one transfer each (no per-value sync)."""
    out: list[float] = [0.0] * len(tensors)
    elsewhere: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_cpu:
            out[i] = float(t.item())
        else:
            elsewhere.setdefault((t.device, t.dtype), []).append(i)
    for where in elsewhere.values():
        stacked = torch.stack([tensors[i].reshape(()) for i in where])
        for i, value in zip(where, stacked.tolist(), strict=True):
            out[i] = float(value)
    return out


def format_floats(values: list[float]) -> list[str]:
    """The text of each value for a CSV cell: a value a float32 holds exactly (what a float32,
    float16 or bfloat16 metric reads as) in the shortest form that gives that float32 back, so
    a logged ``0.49`` reads ``0.49``, not ``0.49000000953674316``; any other in Python's
    shortest form (``repr``). One vectorized conversion for all of them.

    Example:
        >>> format_floats([float(torch.tensor(0.49)), 1 / 3, 2.0**40 + 1])
        ['0.49', '0.3333333333333333', '1099511627777.0']
    """
    if not values:
        return []
    wide = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(np.float32)
        exact = narrow == wide  # False for NaN: Python writes it
    text: list[str] = narrow.astype(str).tolist()
    if not exact.all():
        for i in np.flatnonzero(~exact).tolist():
            text[i] = repr(values[i])
    return text
