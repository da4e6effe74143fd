"""A small training run used by the distributed tests (and importable for the 1-process reference).

    python train.py --out weights.pt [--accelerator cpu --devices 2 --strategy ddp|fsdp] [--empty-init]

Options left out fall back to the TORCHRIG_* variables (what ``torchrig run`` sets).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig

STEPS_DATA = 64  # samples; with a global batch of 16 that is 4 steps per epoch
EPOCHS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(STEPS_DATA, 6, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


def reference_init() -> dict[str, torch.Tensor]:
    """The initial weights every run starts from (a fixed seed)."""
    torch.manual_seed(0)
    return Net().state_dict()


def train(
    rig: torchrig.Rig, *, global_batch: int = 16, empty_init: bool = False
) -> tuple[dict[str, torch.Tensor], int]:
    """Train ``Net`` for a few steps; returns the full final state dict (on rank 0) and how many
    parameter elements this rank holds."""
    rig.seed_everything(7)
    init = reference_init()
    with rig.init_module(empty_init=empty_init):
        model = Net()
    if not empty_init:
        model.load_state_dict(init)
    loader = DataLoader(dataset(), batch_size=global_batch // rig.world_size, shuffle=True)
    if empty_init:  # the optimizer made before prepare: prepare swaps in the sharded parameters
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = rig.prepare(model, optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model.module, init, options=StateDictOptions(full_state_dict=True))
    else:  # the optimizer made after prepare
        model = rig.prepare(model)
        optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    rig.seed_everything(8)  # the shuffle seed must not depend on how the model was initialised
    loader = rig.prepare(loader)
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return rig.strategy.module_state_dict(model), local_numel(model)


def local_numel(model: nn.Module) -> int:
    """Parameter elements held by this rank (a shard's size under FSDP)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--accelerator", default=None)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--empty-init", action="store_true")
    args = parser.parse_args()
    rig = torchrig.Rig(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy)
    state, local = train(rig, empty_init=args.empty_init)
    if rig.is_global_zero:
        torch.save(state, args.out)
        info = {
            "world_size": rig.world_size,
            "strategy": type(rig.strategy).__name__,
            "precision": rig.precision.name,
            "keys": sorted(state),
            "local_numel": local,
            "numel": sum(t.numel() for t in state.values()),
        }
        Path(args.out + ".json").write_text(json.dumps(info))
    rig.barrier()


if __name__ == "__main__":
    main()
