"""The docs/rig.md preemption recipe in a hand-written loop, 2 processes from torchrig's launcher.

    python preempt_rig.py CKPT_DIR

Rank 1 sends itself SIGTERM after step 5; every rank prints ``rank R stopped at step S``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig


def main() -> None:
    ckpt = Path(sys.argv[1])
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(400, 6, generator=g), torch.randn(400, 1, generator=g))
    model = nn.Linear(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer, loader = rig.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for step, (x, y) in enumerate(loader, start=1):
        rig.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == 5 and rig.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if sig := rig.preempted():
            rig.save(ckpt / f"step-{step}", {"model": model, "optimizer": optimizer, "data": loader, "step": step})
            print(f"rank {rig.global_rank} stopped at step {step}", flush=True)
            raise torchrig.Preempted(sig)
    print(f"rank {rig.global_rank} was never stopped", flush=True)


if __name__ == "__main__":
    main()
