"""From a hand-written PyTorch loop to the same loop on Rig.

``train_raw`` is an ordinary loop that picks a device by hand. ``train_rig`` is the same loop,
line for line, with a :class:`torchrig.Rig` doing the device (and, if you ask it, the
precision and the processes). Both train the same model on the same data from the same seed
and this script checks that they end at a similar loss.

Run it::

    python examples/raw_to_rig.py            # trains both, prints both losses
    python examples/raw_to_rig.py --diff     # prints the difference between the two loops

Under ``torchrig run --devices 2 examples/raw_to_rig.py`` (or ``torchrun --nproc-per-node 2``)
the Rig loop runs data-parallel on 2 processes with no change (each process reads its own half
of the data and the gradients are averaged); the hand-written one would need a sampler, DDP
and a process group for that, and here simply trains the whole thing in each process.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig

SEED = 0
EPOCHS = 8
BATCH_SIZE = 32
LR = 0.05


def make_data(n: int = 1024, features: int = 16, classes: int = 4) -> TensorDataset:
    """A fixed synthetic classification problem (labels from a random linear teacher)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(features: int = 16, classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, device: torch.device) -> float:
    """The mean cross-entropy over the whole data set (one host sync, at the end)."""
    x, y = (t.to(device) for t in dataset.tensors)
    return float(F.cross_entropy(model(x), y).item())


def train_raw(dataset: TensorDataset, epochs: int = EPOCHS) -> float:
    torch.manual_seed(SEED)
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    for _epoch in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return evaluate(model, dataset, device)


def train_rig(dataset: TensorDataset, epochs: int = EPOCHS) -> float:
    torch.manual_seed(SEED)
    rig = torchrig.Rig(accelerator="auto")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    model, optimizer, loader = rig.prepare(model, optimizer, loader)
    for _epoch in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            rig.backward(loss)
            optimizer.step()
    return evaluate(model, dataset, rig.device)


def loop_diff() -> str:
    """The unified diff from ``train_raw`` to ``train_rig`` (what the README shows)."""
    raw = inspect.getsource(train_raw).splitlines(keepends=True)
    rig = inspect.getsource(train_rig).splitlines(keepends=True)
    return "".join(difflib.unified_diff(raw, rig, "raw loop", "Rig loop", n=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diff", action="store_true", help="print the diff of the two loops and exit")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args(argv)
    if args.diff:
        print(loop_diff(), end="")
        return 0
    dataset = make_data()
    train_raw(dataset, 1)  # untimed: the first loop in a process pays PyTorch's one-time set-up
    start = time.perf_counter()
    raw = train_raw(dataset, args.epochs)
    middle = time.perf_counter()
    rig = train_rig(dataset, args.epochs)
    end = time.perf_counter()
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every process runs main(); one reports
        return 0
    print(f"hand-written loop: final loss {raw:.4f} in {middle - start:.2f}s")
    print(f"Rig loop:          final loss {rig:.4f} in {end - middle:.2f}s")
    # Same model, data and seed; only the shuffling order differs (Rig's loader draws its order
    # from a seeded, resumable sampler), so the two losses agree closely but not bit for bit.
    if abs(raw - rig) > 0.1 * max(raw, rig) + 0.02:
        print(f"the two loops disagree: {raw:.4f} vs {rig:.4f}", file=sys.stderr)
        return 1
    print("the two loops agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
