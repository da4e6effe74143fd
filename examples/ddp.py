"""Data-parallel training with torchrig: the same script on 1 or N processes.

    python examples/ddp.py                          # 2 CPU processes (this one starts the other)
    python examples/ddp.py --devices 1              # one process
    torchrig run --devices 2 examples/ddp.py        # processes started (and watched) by torchrun
    torchrun --nproc-per-node 2 examples/ddp.py     # the same, torchrun directly

On a GPU machine add ``--accelerator cuda --devices 2 --precision bf16-mixed``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig


def make_data(n: int, seed: int) -> TensorDataset:
    """Two interleaved spirals: a small task a tiny MLP learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 3 * torch.pi
    label = torch.randint(0, 2, (n,), generator=g)
    r = t / (3 * torch.pi)
    angle = t + label * torch.pi
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1) + 0.02 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default=None)
    parser.add_argument("--devices", default=None)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    # Without a launcher, default to two CPU processes (this one starts the other); under
    # torchrun / `torchrig run` leave the choice to them (None = their TORCHRIG_* variables).
    launched = "WORLD_SIZE" in os.environ
    rig = torchrig.Rig(
        accelerator=args.accelerator or (None if launched else "cpu"),
        devices=args.devices or (None if launched else 2),
        strategy=args.strategy,
        precision=args.precision,
    )
    rig.seed_everything(0)
    rig.print(f"{rig}")

    model = nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # batch_size is per process: with N processes a step sees N x 32 samples.
    train = DataLoader(make_data(2048, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(make_data(501, seed=2), batch_size=64)  # 501 does not split evenly: padding
    model, optimizer, train, val = rig.prepare(model, optimizer, train, val)

    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros((), device=rig.device)
        for x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()  # stays on the device: no host sync per step
        mean_loss = rig.all_reduce(total / len(train), op="mean")

        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for x, y in val:
                # every rank's predictions, in dataset order, without the padded duplicates
                pred, target = rig.gather_for_metrics((model(x).argmax(dim=1), y))
                correct += int((pred == target).sum())
                seen += target.numel()
        rig.print(
            f"epoch {epoch}: train loss {mean_loss.item():.4f}  val accuracy {correct / seen:.3f} ({seen} samples)"
        )


if __name__ == "__main__":
    main()
