"""``ItemWindow``: the token-weighted gradient of one optimizer step, for a ``training_step``
that returns ``{"loss": loss_sum, "num_items": n}`` (see :mod:`torchrig.trainer.step_runner`,
whose training step uses it)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.distributed as dist

from torchrig.dtensors import local_tensors


class ItemWindow:
    """The token-weighted gradient of one optimizer step (``training_step`` returned
    ``{"loss": loss_sum, "num_items": n}``): the sum of every micro-batch's ``loss_sum`` over
    the accumulation window and every process, divided by the sum of their ``num_items``,
    which is the gradient of one batch holding all of them.

    Each micro-batch's ``loss_sum`` is backpropagated as it is; the counts add up (Python numbers
    on the host, tensors on their device: no host sync). Right after the window's last forward the
    count is summed over the processes in one asynchronous all-reduce, which runs during the last
    backward. Then every gradient is multiplied by ``world_size / total`` in place (one
    ``torch._foreach_mul_`` per device, over the local shards of DTensor gradients, so tensor
    parallel's split and unsplit parameters scale together), before clipping and the
    GradScaler's unscale. DDP and FSDP2 average the gradients over the data-parallel processes,
    hence ``world_size``; summing the counts over every process counts a tensor-parallel group's
    shared batch once per member, which the same factor cancels. A window whose count is 0 on
    every process gets zero gradients.
    """

    __slots__ = ("dev", "device", "host", "open", "optimizers", "plain_at", "start", "total", "work", "world")

    def __init__(self, world: int, device: torch.device, optimizers: list[Any]) -> None:
        self.world, self.device, self.optimizers = world, device, optimizers
        self.host: int | float = 0  # the counts given as Python numbers
        self.dev: torch.Tensor | None = None  # the counts given as tensors
        self.start = 0  # the window's first batch index
        self.plain_at = -1  # the last batch that returned a plain loss (set by the loop)
        self.open = False  # this window has a count
        self.work: Any = None  # the all-reduce in flight
        self.total: Any = None

    def add(self, output: dict[str, Any], batch_idx: int, accumulate: int, boundary: bool) -> torch.Tensor:
        """Count ``output["num_items"]``; the loss to backpropagate (``output["loss"]`` itself)."""
        loss, n = output.get("loss"), output["num_items"]
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"training_step returned a dict with 'num_items' and loss={_short(loss)}; return "
                "{'loss': loss_sum, 'num_items': n}: the loss tensor summed (not averaged) over the n items"
            )
        if not self.open:
            self.open, self.start = True, batch_idx - batch_idx % accumulate
        if type(n) is int or type(n) is float:
            if not (n >= 0 and math.isfinite(n)):
                raise ValueError(f"training_step returned num_items={n!r}; it must be a finite number >= 0")
            self.host += n
        elif isinstance(n, torch.Tensor) and n.ndim == 0 and not (n.dtype == torch.bool or n.is_complex()):
            n = n.detach()
            self.dev = n if self.dev is None else self.dev + n
        elif isinstance(n, numbers.Real) and not isinstance(n, bool):  # a NumPy number, a Fraction...
            self.add({"loss": loss, "num_items": float(n)}, batch_idx, accumulate, False)
        else:
            raise TypeError(
                f"training_step returned num_items={_short(n)}; it must be an int, a float or a 0-d tensor "
                "(the number of items loss sums over, such as non-padding tokens: mask.sum())"
            )
        if boundary and self.world > 1:  # the last forward of the window: start the count's all-reduce
            self._launch()
        return loss

    def _launch(self) -> None:
        total = self._local_total()
        if not isinstance(total, torch.Tensor):  # a fill kernel, not a host-to-device copy
            total = torch.full((), total, device=self.device)
        elif total.device != self.device:
            total = total.to(self.device)
        elif total is self.dev:  # may be the tensor training_step returned: reduce a copy
            total = total.clone()
        self.total = total
        self.work = dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True)

    def _local_total(self) -> torch.Tensor | int | float:
        if self.dev is None:
            return self.host
        return self.dev + self.host if self.host else self.dev

    def finish(self, batch_idx: int) -> None:
        """At the window's end, after its last backward: scale the gradients by ``world / total``."""
        if self.plain_at >= self.start:
            raise TypeError(
                f"training_step returned a dict with 'num_items' for some batches of the accumulation window "
                f"{self.start}..{batch_idx} and a plain loss for others; return num_items from every "
                "training_step or from none (on every process)"
            )
        if self.world > 1:
            if self.work is None:  # the window's last batch returned None: nothing launched yet
                self._launch()
            self.work.wait()
            scale: torch.Tensor | float = torch.nan_to_num(self.world / self.total, posinf=0.0)
        else:
            total = self._local_total()
            if isinstance(total, torch.Tensor):
                scale = torch.nan_to_num(1 / total, posinf=0.0)
            else:
                scale = 1 / total if total else 0.0
        self.host, self.dev, self.open, self.work, self.total = 0, None, False, None, None
        grads = [p.grad for o in self.optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        # Tensor parallel leaves the parameters outside its plan (norms) plain tensors, which one
        # foreach call cannot mix with DTensors: each rank scales its own shards by the same factor,
        # which scales every placement (sharded, replicated, partial) alike.
        grads = local_tensors(grads)
        devices = {g.device for g in grads}
        if len(devices) == 1:
            torch._foreach_mul_(grads, _on(scale, devices.pop()))
            return
        for device in devices:
            torch._foreach_mul_([g for g in grads if g.device == device], _on(scale, device))


def _on(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor | float:
    """``scale`` usable with tensors on ``device``."""
    if isinstance(scale, torch.Tensor) and scale.device != device:
        # A count returned as a CPU tensor on an accelerator run: reading CPU memory is no device sync.
        return scale.item() if scale.device.type == "cpu" else scale.to(device)
    return scale


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{text[:60]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"
