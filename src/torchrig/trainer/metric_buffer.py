"""``MetricBuffer``: logged rows whose tensors stay on their device until a flush reads them all at once."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchrig.trainer.metrics import Snapshot

#: One written row: ``(step, epoch, {name: value})``.
Row = tuple[int, "int | None", dict[str, float]]


class MetricBuffer:
    """Rows of logged metrics whose tensor values stay on their device until :meth:`drain`.

    Each :meth:`add` copies its tensors in one ``torch.stack`` (they may be changed in place
    later: a parameter, a running sum), except those of a
    :class:`~torchrig.trainer.metrics.Snapshot`, which nothing changes; :meth:`drain` joins
    everything buffered per device and moves it to the host in one transfer per device.

    Example:
        >>> buf = MetricBuffer()
        >>> buf.add({"loss": torch.tensor(0.5)}, step=1, epoch=0)
        1
        >>> buf.drain()
        [(1, 0, {'loss': 0.5})]
    """

    def __init__(self) -> None:
        # (step, epoch, row) where row maps each name to a float or a (pack, index) position.
        self._rows: list[tuple[int, int | None, dict[str, Any]]] = []
        self._packs: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(
        self, metrics: dict[str, float | torch.Tensor], *, step: int, epoch: int | None, skip: str | None = None
    ) -> int:
        """Buffer one row (without the item named ``skip``); returns how many rows are buffered. No host sync."""
        row: dict[str, Any] = {}
        if type(metrics) is Snapshot:  # the Trainer's: scalars checked when logged, nothing changes them
            for name, value in metrics.items():
                if name == skip:
                    continue
                if isinstance(value, torch.Tensor):
                    pack = value if value.dim() == 0 else value.reshape(())
                    self._packs.append(pack)
                    row[name] = (pack, 0)
                else:
                    row[name] = float(value)
            self._rows.append((int(step), epoch, row))
            return len(self._rows)
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, value in metrics.items():
            if name == skip:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"logged metric {name!r} has shape {tuple(value.shape)}; loggers take scalars "
                        "(log a reduction such as value.mean())"
                    )
                tensors.append((name, value.detach() if value.requires_grad else value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                row[name] = float(value)
            else:
                raise TypeError(f"logged metric {name!r} is a {type(value).__name__}; log a number or a scalar tensor")
        if len(tensors) == 1:  # one small copy
            name, t = tensors[0]
            pack = (t if t.dim() == 0 else t.reshape(())).clone()
            self._packs.append(pack)
            row[name] = (pack, 0)
        elif tensors:
            groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
            for name, t in tensors:
                groups.setdefault((t.device, t.dtype), []).append((name, t))
            for items in groups.values():
                pack = torch.stack([t if t.dim() == 0 else t.reshape(()) for _, t in items])  # a copy
                self._packs.append(pack)
                row.update((name, (pack, i)) for i, (name, _) in enumerate(items))
        self._rows.append((int(step), epoch, row))
        return len(self._rows)

    def drain(self) -> list[Row]:
        """Convert every buffered tensor to a float (one transfer per device) and empty the buffer."""
        rows, packs = self._rows, self._packs
        self._rows, self._packs = [], []
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for pack in packs:
            by_device.setdefault(pack.device, {}).setdefault(pack.dtype, []).append(pack)
        where: dict[int, tuple[list[float], int]] = {}  # id(pack) -> (its device's values, first index)
        for device, groups in by_device.items():
            # float32 holds every float16/bfloat16/float32 value exactly; float64 also int metrics
            # (MPS has no float64).
            narrow_only = all(dtype in _NARROW for dtype in groups)
            target = torch.float32 if narrow_only or device.type == "mps" else torch.float64
            parts, segments, order = [], [], []
            for dtype, group in groups.items():
                joined = _join(group)
                parts.append(joined if joined.dtype == target else joined.to(target))
                segments.append((dtype in _NARROW, joined.numel()))
                order.extend(group)
            host = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()  # the one sync for this device
            values = _readable(host, segments)
            start = 0
            for pack in order:
                where[id(pack)] = (values, start)
                start += pack.numel()
        out: list[Row] = []
        for step, epoch, row in rows:
            read: dict[str, float] = {}
            for name, value in row.items():
                if type(value) is tuple:
                    found, first = where[id(value[0])]
                    read[name] = found[first + value[1]]
                else:
                    read[name] = value
            out.append((step, epoch, read))
        return out


_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _join(packs: list[torch.Tensor]) -> torch.Tensor:
    """One 1-d tensor of every value in ``packs`` (0-d single values and 1-d stacks), in order."""
    if all(p.dim() == 0 for p in packs):
        return torch.stack(packs)
    return torch.cat([p.reshape(-1) for p in packs])


def _readable(host: torch.Tensor, segments: list[tuple[bool, int]]) -> list[float]:
    """Python floats of ``host``; values of the ``narrow`` segments (logged as float32 or
    narrower) rounded to the shortest decimal that gives back the same float32, so a logged
    ``0.49`` reads ``0.49``, not ``0.49000000953674316``."""
    out: list[float] = []
    start = 0
    for narrow, count in segments:
        part = host[start : start + count]
        if narrow:  # numpy prints float32 in its shortest round-trip form
            out.extend(float(text) for text in part.numpy().astype(np.float32).astype(str).tolist())
        else:
            out.extend(part.tolist())
        start += count
    return out
