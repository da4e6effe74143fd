"""BatchNorm with the statistics of the global batch on every process (``sync_batchnorm=True``).

Each process of a data-parallel run normalises its own share of the batch; plain BatchNorm then
uses that share's mean and variance, so N processes train differently from one process with
the whole batch. :func:`convert_sync_batchnorm` turns a module's BatchNorm layers into
:class:`SyncBatchNorm`, whose statistics are reduced over the processes first.

On the devices torch's ``nn.SyncBatchNorm`` kernels serve (CUDA, XPU, HPU, a PrivateUse1
backend) the layers become torch's. On the CPU (gloo), where torch's refuses the input (and DDP
refuses to wrap it), they become this module's :class:`SyncBatchNorm`: the same statistics are
computed with two autograd-aware all-reduces (the sum, then the sum of squared deviations: no
cancellation in ``E[x^2] - E[x]^2``), so the gradients are those of one process with the global
batch too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

#: Device types torch's own SyncBatchNorm kernels refuse: :class:`SyncBatchNorm` serves these.
_OWN_DEVICES = ("cpu",)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch for inputs torch's ``nn.SyncBatchNorm`` refuses (the CPU,
    where DDP also refuses to wrap one of those): see the module docstring. Outside training,
    or without a process group, it is plain BatchNorm."""

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self.process_group or dist.group.WORLD
        if not (self.training and dist.is_initialized() and dist.get_world_size(group) > 1):
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()  # statistics in float32 (a half count is not exact past 2048)
        count = torch.tensor([x.numel() // x.size(1)], dtype=x.dtype, device=x.device)
        total = dist_fn.all_reduce(torch.cat([x.sum(dims), count]), group=group)
        n = total[-1]
        mean = total[:-1] / n
        centred = x - mean.reshape(shape)
        var = dist_fn.all_reduce((centred * centred).sum(dims), group=group) / n  # biased, as BatchNorm uses
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            self._update_running_stats(mean.detach(), var.detach(), n.detach())
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        # momentum None: the cumulative average (BatchNorm's own rule; its one host read, as torch's)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1).clamp(min=1)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def convert_sync_batchnorm(module: nn.Module, strategy: Any = None, device_type: str | None = None) -> nn.Module:
    """Turn every BatchNorm layer of ``module`` into one whose statistics are reduced over every
    process of the default group, with its weights, running statistics and settings (in place;
    returns the module, a new one when ``module`` itself is a BatchNorm layer).

    On the devices torch's kernels serve: ``torch.nn.SyncBatchNorm`` (its own conversion); on
    the CPU (``device_type="cpu"``, or the module's device when not given): :class:`SyncBatchNorm`.
    ``strategy`` (optional): the run's strategy; a tensor-parallel layout is refused, since its
    processes do not each hold a share of the batch.
    """
    tp = getattr(strategy, "tensor_parallel", 1)
    if tp != 1:
        raise ValueError(
            f"sync_batchnorm=True with tensor_parallel={tp}: the processes of a tensor-parallel group hold the "
            "same samples, so BatchNorm statistics cannot be reduced over all processes; use a norm layer "
            "without batch statistics (LayerNorm, GroupNorm, RMSNorm) or data parallelism only"
        )
    if device_type is None:
        first = next(iter(module.parameters()), None)
        device_type = first.device.type if first is not None else "cpu"
    if device_type not in _OWN_DEVICES:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _to_own(module)


def _to_own(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, SyncBatchNorm)):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _to_own(child))
    return module
