"""XLA devices (TPUs), when ``torch_xla`` is installed."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from torchrig.accelerators.base import Accelerator
from torchrig.devices import select_indices


class XLAAccelerator(Accelerator):
    """TPUs and other XLA devices through ``torch_xla``."""

    device_type = "xla"

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return select_indices(devices, device_type="xla", available=XLAAccelerator.auto_device_count())

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        import torch_xla.core.xla_model as xm

        return [xm.xla_device(i) for i in XLAAccelerator.parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        if not XLAAccelerator.is_available():
            return 0
        import torch_xla.runtime as xr

        return int(xr.addressable_runtime_device_count())

    @staticmethod
    def is_available() -> bool:
        if importlib.util.find_spec("torch_xla") is None:
            return False
        try:
            import torch_xla.runtime as xr

            return bool(xr.addressable_runtime_device_count() > 0)
        except Exception:
            return False

    def unavailable_reason(self) -> str:
        if importlib.util.find_spec("torch_xla") is None:
            return "torch_xla is not installed (pip install torch_xla on a TPU host)"
        return "" if self.is_available() else "torch_xla is installed but finds no XLA device"

    def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(device)
        return {k: int(v) for k, v in info.items()}
