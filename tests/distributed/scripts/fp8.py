"""A residual MLP trained 10 AdamW steps under ``precision=fp8-mixed`` (or bf16-mixed) on 2
processes (used by tests/distributed/test_dist_fp8.py).

    python fp8.py --out w.pt --strategy ddp|fsdp --precision fp8-mixed|bf16-mixed

Writes rank 0's full state dict to ``--out`` and, in ``--out``.json, rank 0's losses and the
classes of the model's nn.Linear layers by name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import torchrig

DIM, STEPS = 32, 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--precision", required=True)
    args = parser.parse_args()
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=args.strategy, precision=args.precision)
    torch.manual_seed(0)
    net = Net()
    model = rig.prepare(net)
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = x[:, :4].tanh() + 0.3 * torch.randn(256, 4, generator=g)
    mine_x, mine_y = x.chunk(rig.world_size)[rig.global_rank], y.chunk(rig.world_size)[rig.global_rank]
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(mine_x), mine_y)
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    state = rig.strategy.module_state_dict(model)
    kinds = {name: type(m).__name__ for name, m in net.named_modules() if isinstance(m, nn.Linear)}
    if rig.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in state.items()}, args.out)
        Path(args.out + ".json").write_text(json.dumps({"losses": [float(v) for v in losses], "kinds": kinds}))
    rig.barrier()


if __name__ == "__main__":
    main()
