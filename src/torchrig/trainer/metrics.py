"""Values logged with ``self.log``: kept on the device, reduced when they are read.

A :class:`MetricStore` holds, for one stage (training or evaluation), the latest value of each
``on_step`` metric and an on-device running sum (weighted by batch size) of each ``on_epoch``
metric. Nothing here calls ``.item()``: numbers reach the host only when a logger flushes or a
caller reads :func:`to_floats` (one transfer for all of them).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchrig.rig import Rig


class Snapshot(dict):  # type: ignore[type-arg]
    """Logged values that nothing changes in place: a logger may keep these tensors without a copy.

    The Trainer hands its loggers this kind of dict. A plain dict from elsewhere may hold a
    tensor someone updates in place later (a running sum, a parameter), which a buffering
    logger must copy when it is logged.
    """


@dataclass(frozen=True)
class LogOptions:
    """How one logged name is shown and reduced (fixed by its first ``log`` call in a stage)."""

    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    sync_dist: bool

    @property
    def fields(self) -> list[bool]:
        return [self.prog_bar, self.logger, self.on_step, self.on_epoch, self.sync_dist]

    @functools.cached_property
    def step_only(self) -> bool:
        """Only the latest value is kept, as it is: no epoch sum, no cross-process mean."""
        return self.on_step and not self.on_epoch and not self.sync_dist


class MetricStore:
    """Logged values of one stage, on the device.

    Example:
        >>> store = MetricStore(device=torch.device("cpu"))
        >>> for v in (1.0, 3.0):
        ...     store.log("loss", torch.tensor(v), LogOptions(False, True, False, True, False), batch_size=1)
        >>> to_floats(store.epoch_values())
        {'loss': 2.0}
    """

    def __init__(self, *, device: torch.device, rig: Rig | None = None) -> None:
        self.device = device
        self.rig = rig
        self.options: dict[str, LogOptions] = {}
        self.step: dict[str, torch.Tensor] = {}
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}
        #: Whether ``step_values(for_logger=True)`` is a copy of ``step`` (every step value logged
        #: under its own name); None until ``step_values`` works it out again (after a new name).
        self.logger_step_plain: bool | None = None

    def reset(self) -> None:
        """Forget everything (at the start of an epoch or evaluation run)."""
        self.logger_step_plain = None
        self.options.clear()
        self.step.clear()
        self.sums.clear()
        self.counts.clear()

    def log(self, name: str, value: Any, options: LogOptions, batch_size: int | None = None) -> None:
        """Record ``value`` (a scalar tensor or a number) under ``name``."""
        if fresh_scalar(value, self.device):  # the common case, a loss
            tensor, fresh = value.detach(), True
        else:
            tensor, fresh = self._to_tensor(name, value), _fresh(value)
        known = self.options.get(name)
        if known is None:
            self.options[name] = options
            self.logger_step_plain = None  # a new name: worked out again when next asked
        elif known is not options and known != options:
            raise ValueError(
                f"self.log({name!r}) was called with {options} but earlier in this stage with {known}; "
                "log a name with the same options every time"
            )
        if options.on_step:
            if options.sync_dist and self.rig:
                tensor = self.rig.all_reduce(tensor, "mean")  # a new tensor
            elif not fresh:
                tensor = tensor.clone()  # read later (loggers, the bar): the value now, not then
            self.step[name] = tensor
        if options.on_epoch:
            weight = float(batch_size) if batch_size else 1.0
            previous = self.sums.get(name)
            if previous is None:  # the running sum is our own tensor, from then on updated in place
                self.sums[name] = tensor * weight if weight != 1.0 else tensor.clone()
            else:
                previous.add_(tensor, alpha=weight)
            self.counts[name] = self.counts.get(name, 0.0) + weight

    def _to_tensor(self, name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars "
                    "(one number), e.g. value.mean()"
                )
            t = value.detach()
            if t.dim():
                t = t.reshape(())
            if t.dtype != torch.float32 or t.device != self.device:
                t = t.to(device=self.device, dtype=torch.float32)
            return t
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(float(value), device=self.device)
        raise TypeError(f"self.log({name!r}) got {type(value).__name__}; log a number or a scalar tensor")

    def step_values(self, *, for_logger: bool = False, for_prog_bar: bool = False) -> Snapshot:
        """The latest ``on_step`` values (named ``name_step`` when also logged ``on_epoch``)."""
        if for_logger and not for_prog_bar:
            plain = self.logger_step_plain
            if plain is None:  # every step value goes to the logger under its own name?
                plain = self.logger_step_plain = all(
                    o.logger and not o.on_epoch for o in self.options.values() if o.on_step
                )
            if plain:
                return Snapshot(self.step)
        out = Snapshot()
        for name, value in self.step.items():
            opts = self.options[name]
            if (for_logger and not opts.logger) or (for_prog_bar and not opts.prog_bar):
                continue
            out[f"{name}_step" if opts.on_epoch else name] = value
        return out

    def epoch_values(self, *, for_logger: bool = False, for_prog_bar: bool = False) -> Snapshot:
        """Means of the ``on_epoch`` values (``name_epoch`` when also logged ``on_step``),
        averaged across processes for ``sync_dist=True`` names in one collective."""
        out = Snapshot()
        synced: list[str] = []
        for name, total in self.sums.items():
            opts = self.options[name]
            if (for_logger and not opts.logger) or (for_prog_bar and not opts.prog_bar):
                continue
            key = f"{name}_epoch" if opts.on_step else name
            out[key] = total / self.counts[name]
            if opts.sync_dist:
                synced.append(key)
        if synced and self.rig is not None and self.rig.world_size > 1:
            reduced = self.rig.all_reduce(torch.stack([out[k] for k in synced]), "mean")
            out.update(zip(synced, reduced.unbind(0), strict=True))
        return out

    def logger_keys(self, values: Mapping[str, torch.Tensor]) -> Snapshot:
        """The items of ``values`` (from :meth:`epoch_values`) whose names go to the logger."""
        out = Snapshot()
        for key, value in values.items():
            opts = self.options.get(key) or self.options.get(key.removesuffix("_epoch"))
            if opts is None or opts.logger:
                out[key] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        """The running sums, so a resumed epoch's means include the batches before the stop."""
        return {
            "sums": {k: v.detach().cpu() for k, v in self.sums.items()},
            "counts": dict(self.counts),
            "options": {k: o.fields for k, o in self.options.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.options.update({k: LogOptions(*v) for k, v in state.get("options", {}).items()})
        self.sums.update({k: v.to(self.device) for k, v in state.get("sums", {}).items()})
        self.counts.update(state.get("counts", {}))


def fresh_scalar(value: Any, device: torch.device) -> bool:
    """Whether ``value`` is logged as it is (detached, no conversion, no copy): a float32 scalar
    on ``device`` that a computation just made (see :func:`_fresh`), as a loss is."""
    return (
        type(value) is torch.Tensor
        and value.dim() == 0
        and value.dtype is torch.float32
        and value.device == device
        and _fresh(value)
    )


def _fresh(value: Any) -> bool:
    """Whether the logged ``value`` can be kept without a copy: a number (its tensor is ours) or
    a tensor a computation just made (an autograd result, not a view of something else)."""
    if not isinstance(value, torch.Tensor):
        return True
    return value.grad_fn is not None and not value._is_view()


def to_floats(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Python floats from a dict of scalar tensors, with one device-to-host transfer."""
    tensors = [(k, v) for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if tensors:
        stacked = torch.stack([v.detach().reshape(()).float().to(tensors[0][1].device) for _, v in tensors])
        out.update(zip([k for k, _ in tensors], stacked.tolist(), strict=True))
    return {k: out[k] for k in values}
