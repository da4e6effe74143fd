"""``FSDPStrategy``: parameters, gradients and optimizer state sharded with FSDP2 ``fully_shard``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchrig.strategies.base import reset_parameters
from torchrig.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy

if TYPE_CHECKING:
    from torchrig.wrappers import RigModule

WrapPolicy = Callable[[nn.Module], bool]
#: Device types FSDP2 does not run on (no sharded collectives there).
UNSUPPORTED = {"mps": "MPS has no distributed backend for its tensors", "xla": "XLA shards through torch_xla's SPMD"}


def _as_policy(policy: Any) -> WrapPolicy | None:
    if policy is None:
        return None
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"auto_wrap_policy={policy!r} must hold nn.Module subclasses (the layers to shard)")
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return policy  # type: ignore[no-any-return]
    raise TypeError(
        f"auto_wrap_policy={policy!r} must be a set of layer classes (e.g. {{nn.TransformerEncoderLayer}}) "
        "or a function module -> bool"
    )


class FSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Each submodule the wrap policy selects becomes its own shard group (its parameters are
    gathered just for its forward/backward), then the root module is sharded. Parameters become
    ``DTensor`` shards; optimizers created before ``prepare`` are switched to them.

    Args:
        auto_wrap_policy: layer classes (``{Block}``) or a function ``module -> bool`` choosing the
            submodules that are sharded on their own. None: only the whole model.
        cpu_offload: keep parameter shards, gradients and optimizer state in host memory.
        reshard_after_forward: free gathered parameters after forward (less memory, more traffic).
        mixed_precision: a ``MixedPrecisionPolicy``; default: from the Rig's precision
            (``bf16-mixed`` computes in bf16 and reduces gradients in fp32).
        process_group_backend, timeout, start_method: as for :class:`~torchrig.strategies.ddp.DDPStrategy`.

    Example:
        >>> from torch import nn
        >>> strategy = FSDPStrategy(auto_wrap_policy={nn.TransformerEncoderLayer})
        >>> strategy.sharded
        True
    """

    name = "fsdp"
    #: Checkpoints of this strategy are sharded (torch.distributed.checkpoint).
    sharded = True
    #: ``Rig.prepare`` leaves meta parameters to this strategy: each rank materialises its shard.
    materializes_meta = True

    def __init__(
        self,
        *,
        auto_wrap_policy: set[type[nn.Module]] | Iterable[type[nn.Module]] | WrapPolicy | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        mixed_precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self.auto_wrap_policy = _as_policy(auto_wrap_policy)
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision
        # id(original parameter) -> (its shape, the sharded parameter that replaced it)
        self._swapped: dict[int, tuple[torch.Size, nn.Parameter]] = {}

    def backend(self) -> str:
        device_type = self.parallel_devices[0].type
        if device_type in UNSUPPORTED:
            raise ValueError(
                f"strategy={self.name!r} does not run on {device_type}: {UNSUPPORTED[device_type]}. "
                "Use strategy='ddp' for several processes, or 'single'"
            )
        return super().backend()

    def _shard_kwargs(self) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        root = self.root_device
        if self.cpu_offload and root.type == "cpu":
            raise ValueError(
                "FSDPStrategy(cpu_offload=True) moves shards from an accelerator to host memory, but this run "
                "is already on the CPU; drop cpu_offload"
            )
        return {
            "mesh": init_device_mesh(root.type, (self.world_size,)),
            "mp_policy": self._mixed_precision_policy(),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
            "reshard_after_forward": self.reshard_after_forward,
        }

    def _mixed_precision_policy(self) -> Any:
        """``mixed_precision``, or one from the Rig's precision (compute in its autocast dtype, reduce in fp32)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision is not None:
            return self.mixed_precision
        dtype = self.precision.autocast_dtype if self.precision is not None else None
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard the policy's submodules, then the root; materialise meta parameters shard by shard."""
        before = {name: (id(p), p.shape) for name, p in module.named_parameters()}
        on_meta = any(p.is_meta for p in module.parameters())
        if not on_meta and not self.cpu_offload:
            module = module.to(self.root_device)
        module = self._parallelize(module)
        if on_meta:
            module.to_empty(device=self.root_device)  # only the local shards get memory
            reset_parameters(module)
        after = dict(module.named_parameters())
        for name, (old_id, shape) in before.items():
            if name in after:
                self._swapped[old_id] = (shape, after[name])
        for param in after.values():  # a parameter left whole (not split by tensor parallel, no FSDP) is its own
            self._swapped.setdefault(id(param), (param.shape, param))
        return module

    def _parallelize(self, module: nn.Module) -> nn.Module:
        """Shard the policy's submodules (innermost first, as ``fully_shard`` expects), then the root."""
        from torchrig.parallel import apply_fsdp

        kwargs = self._shard_kwargs()
        return apply_fsdp(module, kwargs.pop("mesh"), wrap_policy=self.auto_wrap_policy, **kwargs)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point the optimizer at the sharded parameters (it may have been made before ``prepare``)."""
        if optimizer.state:
            raise ValueError(
                "the optimizer already has state (it has stepped), but FSDP replaces the parameters with "
                "shards in prepare(); prepare the optimizer before its first step and load saved state after"
            )
        for group in optimizer.param_groups:
            group["params"] = [self._sharded(p) for p in group["params"]]
        return optimizer

    def _sharded(self, param: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):
            return param
        found = self._swapped.get(id(param))
        if found is None or found[0] != param.shape:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in any module "
                f"prepared with strategy={self.name!r}; prepare the model before (or together with) its optimizer"
            )
        return found[1]

    def manual_step_caller(self, module: RigModule, method: Callable[..., Any]) -> Callable[..., Any]:
        """Call ``training_step`` directly (under the precision), not as the root module's forward.

        FSDP2's hooks belong to each ``fully_shard`` module and run around each call of one: its
        pre-forward all-gathers the parameters, its post-forward reshards them and hooks the
        output, whose backward queues the root's final callback; that callback reduce-scatters
        the gradients when the backward ends. Run as the root's forward, a step would keep the
        root's parameters gathered through every backward and ``optimizer.step()`` inside it (and
        no backward would reach the output hook). Called directly, each ``self(x)`` (or call of a
        submodule sharded on its own, ``auto_wrap_policy``) inside the step is a forward of its
        own: gathered with the latest weights, and each ``manual_backward`` ends in FSDP's
        reduce-scatter (skipped inside ``no_backward_sync``: ``set_requires_gradient_sync``).
        """
        root = module._forward_module
        _init_root(root)  # a submodule called first must not become a root of its own
        call = module.direct_caller(method)

        def step(*args: Any) -> Any:
            try:
                return call(*args)
            except RuntimeError as err:
                if "mixed torch.Tensor and DTensor" not in str(err):
                    raise
                raise RuntimeError(
                    f"under manual optimization with strategy={self.name!r}, training_step runs outside the "
                    "model's forward, where FSDP keeps only each rank's shard of the parameters: call self(...) "
                    "(the sharded root), or submodules sharded on their own "
                    "(FSDPStrategy(auto_wrap_policy={YourSubmodule, ...})), not a submodule inside the "
                    f"root's shard. torch said: {err}"
                ) from err

        return step

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        return (
            _no_gradient_sync(module)
            if enabled and hasattr(module, "set_requires_gradient_sync")
            else (contextlib.nullcontext())
        )

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full state dict, gathered to rank 0 in host memory (other ranks get ``{}``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from torchrig.strategies.ddp import unwrap_module

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(unwrap_module(module), options=options)

    def __repr__(self) -> str:
        return f"FSDPStrategy(cpu_offload={self.cpu_offload}, reshard_after_forward={self.reshard_after_forward})"


def _init_root(module: nn.Module) -> None:
    """Make ``module`` the root of its FSDP2 tree now, as its first forward would.

    FSDP2 picks the root lazily: the first ``fully_shard`` module to run a forward becomes it,
    and a later forward of an outer one then fails ("FSDP requires running forward through the
    root module first"). A manual ``training_step`` may call a sharded submodule before ``self``.
    torch has no public call for this: ``FSDPState._lazy_init`` is private (idempotent), kept to
    this one function; tests/trainer/test_manual_optimization.py fails if it changes.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is not None:
        get_state()._lazy_init()


@contextlib.contextmanager
def _no_gradient_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]
