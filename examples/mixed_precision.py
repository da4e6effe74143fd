"""Every precision this machine supports, side by side: the same training run, its loss and time.

The same model, data, seed and number of steps run once per precision that the device can do
(:func:`torchrig.precision.supported_precisions` probes the device itself; torchrig never
falls back to fp32 behind your back). The only line that changes between runs is
``torchrig.Rig(precision=...)``.

Run it::

    python examples/mixed_precision.py                    # the best device here, all its precisions
    python examples/mixed_precision.py --accelerator cpu --steps 400

On a CPU the half precisions are emulated by most processors, so they are usually slower than
fp32 there; on a GPU ``bf16-mixed`` and ``16-mixed`` are the fast ones.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchrig
from torchrig.precision import supported_precisions


def make_data(n: int = 2048, features: int = 32, classes: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic classification problem (labels from a random linear teacher)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return x, y


def train(precision: str, accelerator: str, steps: int, batch_size: int) -> tuple[float, float, str]:
    """Train from seed 0 under ``precision``; returns (final loss, seconds, device)."""
    torchrig.seed_everything(0)
    rig = torchrig.Rig(accelerator=accelerator, precision=precision)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    # Plain SGD: Adam's epsilon (1e-8) underflows to zero in float16, which 16-true would expose.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rig.prepare(model, optimizer)
    x, y = rig.to_device(make_data())
    start = time.perf_counter()
    for step in range(steps):
        i = (step * batch_size) % (len(x) - batch_size)
        loss = F.cross_entropy(model(x[i : i + batch_size]), y[i : i + batch_size])
        optimizer.zero_grad()
        rig.backward(loss)
        optimizer.step()
    with torch.no_grad():
        final = float(F.cross_entropy(model(x), y).float().item())  # the one host sync of the run
    return final, time.perf_counter() - start, str(rig.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda, mps, xpu, or a registered name")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per precision")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precisions", nargs="*", help="only these (default: all the device supports)")
    args = parser.parse_args(argv)

    device_type = torchrig.Rig(accelerator=args.accelerator).device.type
    precisions = args.precisions or supported_precisions(device_type)
    train(precisions[0], args.accelerator, 5, args.batch_size)  # untimed warm-up of PyTorch itself
    print(f"{args.steps} steps of a 3-layer MLP, batch {args.batch_size}, on {device_type}")
    print(f"{'precision':<12}{'final loss':>12}{'time (s)':>10}{'steps/s':>10}")
    failed = []
    for name in precisions:
        loss, seconds, _ = train(name, args.accelerator, args.steps, args.batch_size)
        print(f"{name:<12}{loss:>12.4f}{seconds:>10.2f}{args.steps / seconds:>10.0f}")
        if not math.isfinite(loss):
            failed.append(name)
    if failed:
        print(f"non-finite loss under: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
