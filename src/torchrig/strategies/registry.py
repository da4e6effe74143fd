"""``STRATEGY_REGISTRY``: every process layout torchrig can select by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.registry import Registry

if TYPE_CHECKING:
    from torchrig.strategies.base import Strategy

#: Strategies by short name. Third-party packages register through the entry-point group
#: ``torchrig.strategies``.
STRATEGY_REGISTRY: Registry[Strategy] = Registry(
    kind="strategy", entry_point_group="torchrig.strategies", hook="register_strategies"
)
