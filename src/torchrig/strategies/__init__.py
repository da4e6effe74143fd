"""Strategies: how processes and replicas are laid out."""

from __future__ import annotations

from torchrig.strategies.base import Strategy
from torchrig.strategies.registry import STRATEGY_REGISTRY
from torchrig.strategies.single import SingleDeviceStrategy

STRATEGY_REGISTRY.register_builtin("single", SingleDeviceStrategy, description="One process on one device")

__all__ = ["STRATEGY_REGISTRY", "SingleDeviceStrategy", "Strategy"]
