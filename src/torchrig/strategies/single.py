"""One process, one device."""

from __future__ import annotations

from torchrig.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Everything in this process on one device; collectives are free identities.

    Example:
        >>> import torchrig
        >>> torchrig.Rig(accelerator="cpu", strategy="single").strategy
        SingleDeviceStrategy()
    """
