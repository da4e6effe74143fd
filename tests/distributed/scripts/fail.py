"""Rank 1 raises in the middle of training; every rank must stop, naming rank 1 and its error.

python fail.py            # strategy="ddp": this process starts rank 1 and watches it
torchrun ... fail.py      # torchrun starts and watches both ranks
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn

import torchrig
from torchrig.strategies import DDPStrategy


def main() -> None:
    strategy = DDPStrategy(timeout=timedelta(seconds=30))
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=strategy)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rig.prepare(model, optimizer)
    for step in range(1000):
        if step == 3 and rig.global_rank == 1:
            raise RuntimeError("boom on purpose at step 3")
        loss = model(torch.ones(2, 4)).sum()
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print("rank", rig.global_rank, "was never stopped", flush=True)


if __name__ == "__main__":
    main()
