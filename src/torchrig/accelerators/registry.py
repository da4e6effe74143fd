"""``ACCELERATOR_REGISTRY``: every accelerator torchrig can select by name."""

from __future__ import annotations

from typing import Any

from torchrig.accelerators.base import Accelerator
from torchrig.registry import Registry


class AcceleratorRegistry(Registry[Accelerator]):
    """The accelerator registry, plus :meth:`available_accelerators`."""

    def get(self, name: str, **overrides: Any) -> Accelerator:
        """Build the accelerator ``name``; it remembers that name (``"tpu"`` and ``"xla"`` share a class)."""
        acc = super().get(name, **overrides)
        try:
            acc._registry_name = name
        except AttributeError:  # a class with __slots__: name() falls back to searching the registry
            pass
        return acc

    def available_accelerators(self) -> list[str]:
        """Names of the registered accelerators whose hardware is usable in this process."""
        out = []
        for name in self.names():
            try:
                if self.get(name).is_available():
                    out.append(name)
            except Exception:  # a broken plugin is simply not available
                continue
        return out


#: Accelerators by short name. Third-party packages register through the entry-point group
#: ``torchrig.accelerators`` (an Accelerator subclass with ``register_accelerators``, or a
#: function that takes the registry).
ACCELERATOR_REGISTRY = AcceleratorRegistry(
    kind="accelerator", entry_point_group="torchrig.accelerators", hook="register_accelerators"
)
