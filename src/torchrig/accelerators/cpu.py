"""The CPU accelerator: ``devices=`` is the number of processes."""

from __future__ import annotations

import os
from typing import Any

import torch

from torchrig.accelerators.base import Accelerator
from torchrig.devices import parse_process_count


class CPUAccelerator(Accelerator):
    """Runs on the host CPU; ``devices=N`` starts N processes (gloo) with their own threads."""

    device_type = "cpu"

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return parse_process_count(devices, auto=CPUAccelerator.auto_device_count())

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cpu")] * CPUAccelerator.parse_devices(devices)

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
        """Process RSS, system memory and CPU utilisation (through ``psutil``)."""
        try:
            import psutil
        except ImportError:
            return {"error": "psutil is not installed: pip install psutil"}
        proc = psutil.Process(os.getpid())
        vm = psutil.virtual_memory()
        return {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "process_rss_bytes": proc.memory_info().rss,
            "system_memory_used_bytes": vm.used,
            "system_memory_total_bytes": vm.total,
            "system_memory_percent": vm.percent,
        }
