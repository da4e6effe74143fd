"""Values logged with ``self.log``: kept on the device, reduced when they are read.

A :class:`MetricStore` holds, for one stage (training or evaluation), the latest value of each
``on_step`` metric and an on-device running sum (weighted by batch size) of each ``on_epoch``
metric. Nothing here calls ``.item()``: numbers reach the host only when a logger flushes or a
caller reads :func:`to_floats` (one transfer for all of them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchrig.rig import Rig


@dataclass(frozen=True)
class LogOptions:
    """How one logged name is shown and reduced (fixed by its first ``log`` call in a stage)."""

    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    sync_dist: bool
    #: How the epoch's values are reduced (and, with ``sync_dist``, the processes'): one of
    #: :data:`REDUCTIONS`.
    reduce_fx: str = "mean"

    @property
    def fields(self) -> list[bool | str]:
        return [self.prog_bar, self.logger, self.on_step, self.on_epoch, self.sync_dist, self.reduce_fx]


#: The reductions of ``self.log(..., reduce_fx=)``: the mean weighted by ``batch_size``, the sum
#: (not weighted), the largest and the smallest value.
REDUCTIONS = ("mean", "sum", "max", "min")


#: The suffix that keeps each evaluation loader's values apart, with several loaders.
LOADER_SUFFIX = "/dataloader_idx_"


def forked_name(name: str, kind: str) -> str:
    """The name a value logged both ``on_step`` and ``on_epoch`` takes for ``kind`` (``step`` or
    ``epoch``), as in Lightning: ``loss_step``, ``loss_epoch/dataloader_idx_1``."""
    base, sep, idx = name.partition(LOADER_SUFFIX)
    return f"{base}_{kind}{sep}{idx}"


def unforked_name(key: str, kind: str) -> str:
    """The logged name of ``key`` if it is the ``kind`` fork of one (else ``key`` itself)."""
    base, sep, idx = key.partition(LOADER_SUFFIX)
    return base.removesuffix(f"_{kind}") + sep + idx


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
        #: The epoch's means were taken (its end): for ``trainer.callback_metrics`` a name logged
        #: both per step and per epoch then stands for its epoch mean, no longer its last step value.
        self.reduced = False

    def reset(self) -> None:
        """Forget everything (at the start of an epoch or evaluation run)."""
        self.reduced = False
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
        elif known is not options and known != options:
            raise ValueError(
                f"self.log({name!r}) was called with {options} but earlier in this stage with {known}; "
                "log a name with the same options every time"
            )
        if options.on_step:
            if options.sync_dist and self.rig:
                tensor = self.rig.all_reduce(tensor, options.reduce_fx)  # a new tensor
            elif not fresh:
                tensor = tensor.clone()  # read later (loggers, the bar): the value now, not then
            self.step[name] = tensor
        if options.on_epoch:
            reduce = options.reduce_fx
            weight = float(batch_size) if batch_size and reduce == "mean" else 1.0
            previous = self.sums.get(name)
            if previous is None:  # the running value is our own tensor, from then on updated in place
                self.sums[name] = tensor * weight if weight != 1.0 else tensor.clone()
            elif reduce == "max":
                torch.maximum(previous, tensor, out=previous)
            elif reduce == "min":
                torch.minimum(previous, tensor, out=previous)
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

    def step_values(self, *, for_logger: bool = False, for_prog_bar: bool = False) -> dict[str, torch.Tensor]:
        """The latest ``on_step`` values (named ``name_step`` when also logged ``on_epoch``)."""
        out = {}
        for name, value in self.step.items():
            opts = self.options[name]
            if (for_logger and not opts.logger) or (for_prog_bar and not opts.prog_bar):
                continue
            out[forked_name(name, "step") if opts.on_epoch else name] = value
        return out

    def epoch_values(self, *, for_logger: bool = False, for_prog_bar: bool = False) -> dict[str, torch.Tensor]:
        """Means of the ``on_epoch`` values (``name_epoch`` when also logged ``on_step``),
        averaged across processes for ``sync_dist=True`` names in one collective."""
        out: dict[str, torch.Tensor] = {}
        synced: dict[str, list[str]] = {}  # reduction -> the keys reduced across processes with it
        for name, total in self.sums.items():
            opts = self.options[name]
            if (for_logger and not opts.logger) or (for_prog_bar and not opts.prog_bar):
                continue
            key = forked_name(name, "epoch") if opts.on_step else name
            out[key] = total / self.counts[name] if opts.reduce_fx == "mean" else total.clone()
            if opts.sync_dist:
                synced.setdefault(opts.reduce_fx, []).append(key)
        if synced and self.rig is not None and self.rig.world_size > 1:
            for reduce, keys in synced.items():  # one collective per reduction in use
                reduced = self.rig.all_reduce(torch.stack([out[k] for k in keys]), reduce)
                out.update(zip(keys, reduced.unbind(0), strict=True))
        return out

    def logger_keys(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The items of ``values`` (from :meth:`epoch_values`) whose names go to the logger."""
        out: dict[str, torch.Tensor] = {}
        for key, value in values.items():
            opts = self.options.get(key) or self.options.get(unforked_name(key, "epoch"))
            if opts is None or opts.logger:
                out[key] = value
        return out

    def callback_values(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` (from :meth:`epoch_values`) as ``trainer.callback_metrics`` shows them once
        the epoch has ended, as in Lightning: a name logged both per step and per epoch also under
        its own name, with its epoch mean (``loss`` beside ``loss_epoch``), so a monitor of
        ``loss`` reads the mean, not the last step's value."""
        out = dict(values)
        for key, value in values.items():
            name = unforked_name(key, "epoch")
            opts = self.options.get(name)
            if name != key and opts is not None and opts.on_step:
                out[name] = value
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
        and value.grad_fn is not None
        and not value._is_view()
    )


def _fresh(value: Any) -> bool:
    """Whether the logged ``value`` can be kept without a copy: a number (its tensor is ours) or
    a tensor a computation just made (an autograd result, not a view of something else)."""
    if not isinstance(value, torch.Tensor):
        return True
    return value.grad_fn is not None and not value._is_view()


def to_floats(values: Mapping[str, Any]) -> dict[str, float]:
    """``values`` with scalar tensors and numbers as Python floats, in the caller's order, with
    one device-to-host transfer per device (exact: a float32 value is the float it holds).

    Non-scalar tensors and values that are not numbers are left out.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    out: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            by_device.setdefault(value.device, []).append((name, value.detach().reshape(())))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    for device, items in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        floats = torch.stack([t.to(dtype) for _, t in items]).tolist()
        out.update(zip((n for n, _ in items), floats, strict=True))
    return {k: out[k] for k in values if k in out}
