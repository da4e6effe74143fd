"""``DDPStrategy``: one model replica per process, gradients averaged by ``DistributedDataParallel``."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchrig.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module inside a prepared ``RigModule`` and/or ``DistributedDataParallel``: what the
    strategy wrapped; ``torch.compile`` of a prepared module is looked through. A
    ``torch.compile(model)`` wrapper (``OptimizedModule``) of anything else stays (its state-dict
    keys start with ``_orig_mod.``).

    Checkpoints use :func:`torchrig.checkpoint.entries.user_module` instead, which removes that
    wrapper too, so that the keys are the model's own, compiled or not.
    """
    from torchrig.wrappers import as_prepared

    prepared = as_prepared(module)
    if prepared is not None:
        module = prepared._forward_module
    if isinstance(module, DistributedDataParallel):
        module = module.module
    return module


class DDPStrategy(ParallelStrategy):
    """Data parallel: each process holds the whole model; ``DistributedDataParallel`` averages grads.

    Processes come from torchrun or SLURM when they started the script; otherwise from
    ``start_method``: ``"popen"`` (``strategy="ddp"``: this process becomes rank 0 and runs the
    script again for the other ranks), ``"spawn"`` (``"ddp_spawn"``) or ``"fork"``
    (``"ddp_notebook"``), which start ``rig.launch(fn)`` workers.

    Args:
        find_unused_parameters: passed to ``DistributedDataParallel`` (for models whose forward
            skips some parameters).
        static_graph: passed to ``DistributedDataParallel`` (the set of used parameters never changes).
        gradient_as_bucket_view: passed to ``DistributedDataParallel`` (saves a gradient copy).
        process_group_backend: default: PyTorch's backend for the device (gloo, nccl, xccl...).
        timeout: how long a collective waits for the other ranks before failing.
        start_method: ``"popen"``, ``"spawn"`` or ``"fork"`` (see above).

    Example:
        >>> from datetime import timedelta
        >>> import torchrig
        >>> strategy = DDPStrategy(find_unused_parameters=True, timeout=timedelta(minutes=5))
        >>> # rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=strategy)
    """

    name = "ddp"

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to this rank's device and wrap it in ``DistributedDataParallel``."""
        root = self.root_device
        module = module.to(root)
        device_ids = [root.index] if root.type != "cpu" and root.index is not None else None
        return DistributedDataParallel(
            module,
            device_ids=device_ids,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def prepare_for_backward(self, module: nn.Module, loss: torch.Tensor) -> None:
        """Arm DDP's reducer to average the gradients of the backward of ``loss``, as the end of
        DDP's forward does for a forward's single backward (with ``find_unused_parameters``, the
        parameters ``loss`` does not reach are found in its graph)."""
        if not isinstance(module, DistributedDataParallel) or not torch.is_grad_enabled():
            return
        from torch.nn.parallel.distributed import _find_tensors

        module.require_forward_param_sync = True
        find = module.find_unused_parameters and not module.static_graph
        try:
            module.reducer._rebuild_buckets()  # type: ignore[no-untyped-call]
            module.reducer.prepare_for_backward(list(_find_tensors(loss)) if find else [])
        except RuntimeError as err:
            if find or "finished reduction in the prior iteration" not in str(err):
                raise
            raise RuntimeError(
                "an earlier backward in this training_step did not reach every parameter (a GAN's "
                "discriminator loss does not reach the generator), so DDP never finished averaging its "
                "gradients; pass strategy=torchrig.DDPStrategy(find_unused_parameters=True). DDP said: "
                f"{err}"
            ) from err

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full state dict with the user's keys (no ``module.`` prefix from DDP)."""
        return unwrap_module(module).state_dict()

    def __repr__(self) -> str:
        opts = []
        if self.find_unused_parameters:
            opts.append("find_unused_parameters=True")
        if self.static_graph:
            opts.append("static_graph=True")
        if self.start_method != "popen":
            opts.append(f"start_method={self.start_method!r}")
        return f"DDPStrategy({', '.join(opts)})"
