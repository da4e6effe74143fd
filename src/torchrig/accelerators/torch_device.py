"""One generic accelerator for every device type PyTorch knows through ``torch.accelerator``.

CUDA (and ROCm), MPS, XPU, and any PrivateUse1 backend (``npu``, ``hpu``, or one renamed with
``torch.utils.rename_privateuse1_backend``) are served by the same class: the device module comes
from ``torch.get_device_module(device_type)``, so no vendor needs an ``if`` of its own.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

import torch

from torchrig.accelerators.base import Accelerator
from torchrig.devices import device_module, select_indices, set_device_index

if TYPE_CHECKING:
    from torchrig.fp8 import FP8Mixed
    from torchrig.precision import Precision
    from torchrig.strategies.base import Strategy


def torch_build() -> str:
    """A short description of this PyTorch build, for messages and ``torchrig env``."""
    if torch.version.cuda:
        return f"torch {torch.__version__} built with CUDA {torch.version.cuda}"
    if getattr(torch.version, "hip", None):
        return f"torch {torch.__version__} built with ROCm {torch.version.hip}"
    if getattr(torch.version, "xpu", None):
        return f"torch {torch.__version__} built with XPU {torch.version.xpu}"
    return f"torch {torch.__version__} (a build with no CUDA/ROCm/XPU)"


class TorchDeviceAccelerator(Accelerator):
    """Any ``torch.accelerator`` device type, named by ``device_type``.

    Args:
        device_type: the ``torch.device`` type, such as ``"cuda"``, ``"xpu"``, ``"mps"``, ``"npu"``.
        precision, strategy, precision_plugin, training_type_plugin: what the accelerator
            carries to ``Rig``/``Trainer``, as for :class:`~torchrig.Accelerator`.

    Example:
        >>> acc = TorchDeviceAccelerator(device_type="cuda")
        >>> acc.device_type
        'cuda'
    """

    def __init__(
        self,
        *,
        device_type: str,
        precision: str | int | Precision | FP8Mixed | None = None,
        strategy: str | Strategy | None = None,
        precision_plugin: str | int | Precision | FP8Mixed | None = None,
        training_type_plugin: str | Strategy | None = None,
    ) -> None:
        super().__init__(
            precision=precision,
            strategy=strategy,
            precision_plugin=precision_plugin,
            training_type_plugin=training_type_plugin,
        )
        self.device_type = device_type  # type: ignore[misc]

    # The Accelerator API declares these static; this class serves many device types, so they
    # are instance methods (call them on an instance: ``ACCELERATOR_REGISTRY.get("cuda")``).
    def parse_devices(self, devices: Any) -> list[int]:  # type: ignore[override]
        return select_indices(devices, device_type=self.device_type, available=self.auto_device_count())

    def get_parallel_devices(self, devices: Any) -> list[torch.device]:  # type: ignore[override]
        if not (isinstance(devices, list) and all(isinstance(i, int) for i in devices)):
            devices = self.parse_devices(devices)
        return [torch.device(self.device_type, i) for i in devices]

    def auto_device_count(self) -> int:  # type: ignore[override]
        if not self.is_available():
            return 0
        mod = device_module(self.device_type)
        count = getattr(mod, "device_count", None)
        return int(count()) if callable(count) else 1

    def is_available(self) -> bool:  # type: ignore[override]
        mod = device_module(self.device_type)
        check = getattr(mod, "is_available", None)
        try:
            return bool(check()) if callable(check) else False
        except Exception:
            return False

    def unavailable_reason(self) -> str:
        if self.is_available():
            return ""
        t = self.device_type
        if t == "cuda":
            if not (torch.version.cuda or getattr(torch.version, "hip", None)):
                return f"this PyTorch build has no CUDA: {torch_build()}; install a CUDA build of torch"
            return f"{torch_build()}, but no CUDA device is visible (driver, or CUDA_VISIBLE_DEVICES)"
        if t == "mps":
            return f"MPS needs macOS on Apple silicon; this is {platform.system()} {platform.machine()}"
        if t == "xpu" and not getattr(torch.version, "xpu", None):
            return f"this PyTorch build has no XPU support: {torch_build()}"
        if device_module(t) is None:
            return f"PyTorch has no device module for {t!r} (the backend's package is not imported)"
        return f"torch.{t}.is_available() returned False"

    def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
        """What ``torch.accelerator.memory`` offers: allocated, reserved, peak, free/total.

        Each number comes from ``torch.accelerator`` or, when that cannot answer (a backend
        without a C++ allocator), from the backend's device module; what neither knows is left
        out, so this never raises.
        """
        if not self.is_available():  # torch.cuda answers 0 even on a build without CUDA
            return {}
        device = torch.device(device)
        # torch.accelerator answers for the current accelerator only (asked about another device
        # type, it may answer for the current one's device of the same index).
        current = torch.accelerator.current_accelerator()
        sources = [device_module(self.device_type)]
        if current is not None and current.type == device.type:
            sources.insert(0, torch.accelerator)
        stats: dict[str, Any] = {}
        for key, fn in (
            ("allocated_bytes", "memory_allocated"),
            ("reserved_bytes", "memory_reserved"),
            ("peak_allocated_bytes", "max_memory_allocated"),
            ("peak_reserved_bytes", "max_memory_reserved"),
        ):
            value = _query(sources, fn, device)
            if value is not None:
                stats[key] = int(value)
        info = _query(sources, "get_memory_info", device) or _query(sources, "mem_get_info", device)
        if info is not None:
            stats["free_bytes"], stats["total_bytes"] = int(info[0]), int(info[1])
        return stats

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` current and check that the backend can put a tensor on it.

        Raises:
            RuntimeError: the backend is registered with PyTorch but has no kernels/allocator
                (a device module registered from Python only), so no tensor can live on it.
        """
        if device.index is not None:
            set_device_index(device.index)
        try:
            torch.empty(0, device=device)
        except (NotImplementedError, RuntimeError) as err:
            # PyTorch's message lists every dispatch key; its first sentence is the useful part.
            first = (str(err).strip().split(". ")[0] or type(err).__name__)[:200]
            raise RuntimeError(
                f"the {self.device_type!r} backend is registered with PyTorch, but it cannot allocate a "
                f"tensor on {device} ({first}). A device type registered only from Python "
                "(torch.utils.rename_privateuse1_backend + torch._register_device_module) has no "
                "kernels and no allocator: its C++ extension must register them with the PrivateUse1 "
                "dispatch key. Import the backend's package, or use accelerator='cpu'"
            ) from err

    def teardown(self) -> None:
        mod = device_module(self.device_type)
        empty = getattr(mod, "empty_cache", None)
        if callable(empty) and self.is_available():
            empty()

    def name(self) -> str:
        found = super().name()
        # When a user class took over this type's name (say "xpu"), the device type still names it.
        return self.device_type if found == type(self).__name__ else found

    def __repr__(self) -> str:
        args = ", ".join([f"device_type={self.device_type!r}", *self.carried_repr()])
        return f"TorchDeviceAccelerator({args})"


def _query(sources: list[Any], fn: str, device: torch.device) -> Any:
    """``fn(device)`` from the first of ``sources`` that has it and answers; None when none does."""
    for source in sources:
        f = getattr(source, fn, None)
        if callable(f):
            try:
                return f(device)
            except Exception:  # not supported by this backend: try the next source
                continue
    return None
