"""Accelerators: the base class, the registry, and the built-ins."""

from __future__ import annotations

import torch

from torchrig.accelerators.base import Accelerator
from torchrig.accelerators.cpu import CPUAccelerator
from torchrig.accelerators.registry import ACCELERATOR_REGISTRY, AcceleratorRegistry
from torchrig.accelerators.torch_device import TorchDeviceAccelerator, device_module
from torchrig.accelerators.xla import XLAAccelerator

#: Device types served by the generic class out of the box; any other PrivateUse1 backend is
#: added on first use by :func:`ensure_registered`.
GENERIC_TYPES = {
    "cuda": "NVIDIA CUDA and AMD ROCm GPUs",
    "mps": "Apple silicon GPUs (Metal)",
    "xpu": "Intel GPUs",
    "hpu": "Intel Gaudi (HPU), once its PyTorch plugin is imported",
    "npu": "Ascend NPUs, once torch_npu is imported",
}


def _register_builtins() -> None:
    ACCELERATOR_REGISTRY.register_builtin("cpu", CPUAccelerator, description="The host CPU")
    for t, desc in GENERIC_TYPES.items():
        ACCELERATOR_REGISTRY.register_builtin(t, TorchDeviceAccelerator, description=desc, device_type=t)
    for name in ("xla", "tpu"):
        ACCELERATOR_REGISTRY.register_builtin(name, XLAAccelerator, description="XLA devices (TPUs) via torch_xla")


def privateuse1_name() -> str | None:
    """The name a PrivateUse1 backend gave itself, if one was renamed in this process."""
    name = torch._C._get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def ensure_registered(device_type: str) -> bool:
    """Register the generic accelerator for a device type PyTorch knows but torchrig does not.

    This is what lets a PrivateUse1 backend work with no torchrig code: once it is renamed and
    its device module registered with PyTorch, ``accelerator="<its name>"`` just works.
    """
    if device_type in ACCELERATOR_REGISTRY:
        return True
    if device_type == privateuse1_name() or device_module(device_type) is not None:
        ACCELERATOR_REGISTRY.register_builtin(
            device_type,
            TorchDeviceAccelerator,
            description=f"{device_type} (a backend registered with PyTorch)",
            device_type=device_type,
        )
        return True
    return False


_register_builtins()

__all__ = [
    "ACCELERATOR_REGISTRY",
    "Accelerator",
    "AcceleratorRegistry",
    "CPUAccelerator",
    "TorchDeviceAccelerator",
    "XLAAccelerator",
    "ensure_registered",
    "privateuse1_name",
]
