"""``MetricBuffer``: logged rows whose tensors stay on their device until a flush reads them all at once."""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

#: One written row: ``(step, epoch, {name: value})``.
Row = tuple[int, "int | None", dict[str, float]]


class MetricBuffer:
    """Rows of logged metrics whose tensor values stay on their device until :meth:`drain`.

    :meth:`add` keeps an ``owned`` row as it is (the Trainer's rows: scalars checked when
    logged, nothing changes them), so buffering a step costs one list append. Any other dict is
    checked and its tensors copied (they may be changed in place later: a parameter, a running
    sum). :meth:`drain` reads every buffered value at once: CPU tensors directly, the others with
    one transfer per device and dtype; :meth:`drain_columns` gives the same column by column.

    A step is one row: rows added one after the other at the same step (the Trainer's values of
    a step, a callback's learning rates, the validation run at the end of the epoch) are drained
    as one row holding all their values (a name given twice keeps its later value) and the
    epoch of the first that has one (the epoch the step was trained in). They are merged when
    drained, so :meth:`add` stays one append.

    Example:
        >>> buf = MetricBuffer()
        >>> buf.add({"loss": torch.tensor(0.5)}, step=1, epoch=0)
        1
        >>> buf.drain()
        [(1, 0, {'loss': 0.5})]
        >>> _ = buf.add({"loss": torch.tensor(0.25)}, step=2, epoch=0)
        >>> _ = buf.add({"lr": 0.1}, step=2, epoch=1)
        >>> buf.drain()
        [(2, 0, {'loss': 0.25, 'lr': 0.1})]
    """

    def __init__(self) -> None:
        #: The buffered rows, ``(step, epoch, values, name left out)``: values map names to scalar
        #: tensors or numbers. The list is replaced by a new one at each drain.
        self.rows: list[tuple[int, int | None, dict[str, Any], str | None]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self,
        metrics: dict[str, float | torch.Tensor],
        *,
        step: int,
        epoch: int | None,
        skip: str | None = None,
        owned: bool = False,
    ) -> int:
        """Buffer one row (without the item named ``skip``); returns how many rows are buffered. No host sync.

        ``owned``: ``metrics`` holds scalar tensors and numbers that nothing changes in place
        later (the Trainer's rows), kept as they are, without checks or copies.
        """
        if owned:
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
        rows = self._take()
        floats = iter(_floats([v for *_, values, skip in rows for k, v in values.items() if k != skip]))
        return [
            (int(step), epoch, {k: next(floats) for k in values if k != skip}) for step, epoch, values, skip in rows
        ]

    def drain_columns(self) -> tuple[list[int], list[int | None], dict[str, list[float | None]]]:
        """Every buffered row, column by column; empties the buffer.

        Returns the steps, the epochs and, per metric name in the order first logged, each row's
        value as a float (None where the row has none). Every value is read as :meth:`drain`
        reads it, with no per-row dict.

        Example:
            >>> buf = MetricBuffer()
            >>> _ = buf.add({"loss": torch.tensor(0.5)}, step=1, epoch=0)
            >>> _ = buf.add({"acc": 0.25}, step=2, epoch=None)
            >>> buf.drain_columns()
            ([1, 2], [0, None], {'loss': [0.5, None], 'acc': [None, 0.25]})
        """
        rows = self._take()
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
        read = iter(_floats([v for column in cells.values() for v in column if v is not None]))
        columns = {name: [None if v is None else next(read) for v in column] for name, column in cells.items()}
        return [int(row[0]) for row in rows], [row[1] for row in rows], columns

    def _take(self) -> list[tuple[int, int | None, dict[str, Any], str | None]]:
        """The buffered rows with those of one step next to each other merged into one; empties the buffer.

        A merged row is a new dict without its rows' left out names (an owned row is not changed)."""
        rows, self.rows = self.rows, []
        out: list[tuple[int, int | None, dict[str, Any], str | None]] = []
        merged: dict[str, Any] | None = None  # the last merged row's values (ours: updated in place)
        for row in rows:
            if not out or out[-1][0] != row[0]:
                out.append(row)
                continue
            step, epoch, values, skip = out[-1]
            if values is not merged:
                merged = dict(values)
                if skip is not None:
                    merged.pop(skip, None)
            new, left_out = row[2], row[3]
            if left_out is not None and left_out in new:
                new = {k: v for k, v in new.items() if k != left_out}
            merged.update(new)
            out[-1] = (step, row[1] if epoch is None else epoch, merged, None)
        return out


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
