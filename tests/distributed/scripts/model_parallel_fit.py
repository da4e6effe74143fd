"""The Trainer with ModelParallelStrategy: the demo's tiny transformer inside a TrainingModule.

    python model_parallel_fit.py ROOT OUT --devices 2 --tp 2

Rank 0 writes the full final weights to OUT. Importable for the one-process reference (``fit``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import torchrig
from torchrig.demo.transformer import tiny


class LM(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = tiny()  # its _tp_plan is found inside the TrainingModule ("net.layers.*...")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(root: str, *, devices: int = 1, tp: int = 1) -> tuple[dict[str, torch.Tensor], torchrig.Trainer]:
    from model_parallel import GLOBAL_BATCH, dataset

    strategy: Any = torchrig.ModelParallelStrategy(tensor_parallel=tp) if devices > 1 else "single"
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        gradient_clip_val=0.5,
        seed=1,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )
    module = LM()
    trainer.fit(module, DataLoader(dataset(), batch_size=GLOBAL_BATCH // trainer.rig.strategy.data_parallel_size))
    return trainer.rig.strategy.module_state_dict(module), trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    state, trainer = fit(args.root, devices=args.devices, tp=args.tp)
    if trainer.rig.is_global_zero:
        torch.save(state, args.out)


if __name__ == "__main__":
    main()
