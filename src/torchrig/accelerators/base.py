"""The Accelerator base class: one kind of hardware."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from torchrig.fp8 import FP8Mixed
    from torchrig.precision import Precision
    from torchrig.strategies.base import Strategy


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

    An accelerator may also carry the precision and strategy of the run, which ``Rig`` and
    ``Trainer`` then use when their own ``precision=`` / ``strategy=`` are not given (giving
    both with different values is an error):

        >>> acc = torchrig.CPUAccelerator(precision="bf16", strategy="single")
        >>> acc.precision, acc.strategy
        ('bf16-mixed', 'single')
        >>> torchrig.Rig(accelerator=acc).precision.name
        'bf16-mixed'

    Args:
        precision: a precision name (as ``Rig(precision=)`` takes), a :class:`~torchrig.precision.Precision`
            or a :class:`~torchrig.FP8Mixed`.
        strategy: a strategy name (as ``Rig(strategy=)`` takes) or a :class:`~torchrig.Strategy`.
        precision_plugin: another name for ``precision`` (the one the Accelerator documents use).
        training_type_plugin: another name for ``strategy`` (the one the Accelerator documents use).

    A subclass whose ``__init__`` does not pass these on to ``super().__init__`` carries nothing.
    """

    #: The ``torch.device`` type this accelerator puts tensors on.
    device_type: ClassVar[str] = "cpu"
    #: The name this instance was built under by the registry (set by ``ACCELERATOR_REGISTRY.get``).
    _registry_name: str | None = None
    #: The precision this accelerator carries: a canonical name, a Precision, an FP8Mixed, or None.
    precision: str | Precision | FP8Mixed | None = None
    #: The strategy this accelerator carries: a lower-case name, a Strategy, or None (none).
    strategy: str | Strategy | None = None

    def __init__(
        self,
        *,
        precision: str | int | Precision | FP8Mixed | None = None,
        strategy: str | Strategy | None = None,
        precision_plugin: str | int | Precision | FP8Mixed | None = None,
        training_type_plugin: str | Strategy | None = None,
    ) -> None:
        if precision is None and strategy is None and precision_plugin is None and training_type_plugin is None:
            return  # carries nothing: the class attributes say None
        from torchrig.resolve import carried_choice  # resolve imports this module

        owner = type(self).__name__
        self.precision = carried_choice(owner, "precision", precision, "precision_plugin", precision_plugin)
        self.strategy = carried_choice(owner, "strategy", strategy, "training_type_plugin", training_type_plugin)

    @property
    def precision_plugin(self) -> str | Precision | FP8Mixed | None:
        """The carried precision, under the name the Accelerator documents use."""
        return self.precision

    @property
    def training_type_plugin(self) -> str | Strategy | None:
        """The carried strategy, under the name the Accelerator documents use."""
        return self.strategy

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

    def carried_repr(self) -> list[str]:
        """``["precision='bf16-mixed'", "strategy='ddp'"]``: what this accelerator carries, for reprs."""
        return [f"{k}={v!r}" for k, v in (("precision", self.precision), ("strategy", self.strategy)) if v is not None]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.carried_repr())})"
