"""The Accelerator base class: one kind of hardware."""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class Accelerator:
    """One kind of hardware (CPU, a ``torch.accelerator`` backend, XLA, or your own).

    Subclasses provide the static methods below. A subclass that defines the classmethod
    ``register_accelerators`` is registered in :data:`torchrig.ACCELERATOR_REGISTRY` as soon as
    the class is defined, so ``Rig(accelerator="myname")`` and ``--trainer.accelerator=myname``
    work with no further call.

    Example:
        >>> import torch, torchrig
        >>> class SimAccelerator(torchrig.Accelerator):
        ...     device_type = "cpu"
        ...     @staticmethod
        ...     def parse_devices(devices): return torchrig.CPUAccelerator.parse_devices(devices)
        ...     @staticmethod
        ...     def get_parallel_devices(devices): return [torch.device("cpu")] * devices
        ...     @staticmethod
        ...     def auto_device_count(): return 1
        ...     @staticmethod
        ...     def is_available(): return True
        ...     @classmethod
        ...     def register_accelerators(cls, registry):
        ...         registry.register("sim_doc", cls, description="doc example", override=True)
        >>> torchrig.ACCELERATOR_REGISTRY.get("sim_doc").name()
        'sim_doc'
    """

    #: The ``torch.device`` type this accelerator puts tensors on.
    device_type: ClassVar[str] = "cpu"
    #: The name this instance was built under by the registry (set by ``ACCELERATOR_REGISTRY.get``).
    _registry_name: str | None = None

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        """Turn the user's ``devices=`` value into what ``get_parallel_devices`` takes."""
        raise NotImplementedError

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """The ``torch.device`` of each process, from the parsed ``devices``."""
        raise NotImplementedError

    @staticmethod
    def auto_device_count() -> int:
        """How many devices ``devices="auto"`` means."""
        raise NotImplementedError

    @staticmethod
    def is_available() -> bool:
        """Whether this hardware can be used in this process."""
        raise NotImplementedError

    def unavailable_reason(self) -> str:
        """Why :meth:`is_available` is False, in words (empty when it is available)."""
        return "" if self.is_available() else f"{type(self).__name__}.is_available() returned False"

    def name(self) -> str:
        """The registered name of this accelerator (or its class name when unregistered)."""
        from torchrig.accelerators.registry import ACCELERATOR_REGISTRY

        given = getattr(self, "_registry_name", None)
        if isinstance(given, str):
            return given
        for n in ACCELERATOR_REGISTRY.names():
            entry = ACCELERATOR_REGISTRY.entry(n)
            if entry.factory is type(self) and all(
                getattr(self, k, object()) == v for k, v in entry.init_params.items()
            ):
                return n
        return type(self).__name__

    def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
        """Device statistics for loggers (memory, utilisation); empty when nothing is known."""
        return {}

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current device."""

    def teardown(self) -> None:
        """Release what :meth:`setup_device` took."""

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        """Register this class under its short name(s); override it to make the class selectable."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "register_accelerators" in cls.__dict__:
            from torchrig.accelerators.registry import ACCELERATOR_REGISTRY

            cls.register_accelerators(ACCELERATOR_REGISTRY)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
