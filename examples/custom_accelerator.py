"""A user-written accelerator, selectable as an instance and by its short name.

This is the fictional ``XPUAccelerator`` of the "custom accelerator" recipe, backed by the host
CPU so that it runs anywhere. Defining the class is enough to register it: its
``register_accelerators`` classmethod runs when the class is created, so afterwards
``torchrig.Rig(accelerator="xpu_sim")`` (and, once the Trainer CLI exists,
``--trainer.accelerator=xpu_sim``) selects it with no further call.

It registers as ``"xpu_sim"``, not ``"xpu"`` as the recipe does: ``"xpu"`` is torchrig's
built-in name for real Intel GPUs, and a CPU-backed demo must not take that name over on a
machine that has one. (A real XPU plugin could register ``"xpu"``: a user class may replace a
built-in, and removing it from the registry brings the built-in back.)

Run it::

    python examples/custom_accelerator.py --steps 20
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

import torchrig
from torchrig.devices import select_indices


class XPUAccelerator(torchrig.Accelerator):
    """A simulated XPU: one device that is really the host CPU.

    Example:
        >>> rig = torchrig.Rig(accelerator=XPUAccelerator(), devices=1)
        >>> rig.accelerator.name(), rig.device.type
        ('xpu_sim', 'cpu')
    """

    #: Tensors live on the host: this is what makes the demo runnable without XPU hardware.
    device_type = "cpu"

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        # torchrig's own parser gives the same forms and error messages as the built-ins
        # (counts, -1/"auto", "0,1", [0, 1]) against this accelerator's device count.
        return select_indices(devices, device_type="xpu_sim", available=XPUAccelerator.auto_device_count())

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        # One torch.device per simulated XPU index; every one of them is the host CPU.
        return [torch.device("cpu") for _ in XPUAccelerator.parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
        import psutil

        return {"simulated": True, "process_rss_bytes": psutil.Process(os.getpid()).memory_info().rss}

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(
            "xpu_sim", cls, description="Simulated XPU (the host CPU) from examples/custom_accelerator.py"
        )


def train(rig: torchrig.Rig, *, steps: int) -> tuple[float, float]:
    """Fit y = 3x - 1 with a one-weight linear model; returns the first and last loss."""
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    y = 3 * x - 1
    model = nn.Linear(1, 1)
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.3))
    x, y = rig.to_device((x, y))
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    # One host transfer at the end, not one per step.
    first, last = torch.stack(losses)[[0, -1]].tolist()
    return first, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    print(torchrig.ACCELERATOR_REGISTRY.describe()["xpu_sim"])
    for label, accelerator in (("instance", XPUAccelerator()), ("name", "xpu_sim")):
        rig = torchrig.Rig(accelerator=accelerator, devices=1)
        first, last = train(rig, steps=args.steps)
        stats = rig.accelerator.get_device_stats(rig.device)
        print(
            f"by {label}: accelerator={rig.accelerator.name()} class={type(rig.accelerator).__name__} "
            f"device={rig.device} precision={rig.precision.name} steps={args.steps} "
            f"loss {first:.4f} -> {last:.4f} stats={sorted(stats)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
