"""A fit for the preemption soak: SIGTERM every few optimizer steps, resumed automatically.

    python soak_fit.py ROOT [--term-at 2,3,5] [--async-save] [--devices N]

Each attempt (``TORCHELASTIC_RESTART_COUNT``, set by ``torchrig run --max-restarts`` or by the
test looping in one process) resumes from ``last`` by itself; at the first step of ``--term-at``
after the one it resumed from, the last rank sends itself SIGTERM (the Trainer stops every rank at
an optimizer step and saves). Every rank appends the ids of each batch it trains on to
``ROOT/rankR.jsonl``; rank 0 writes the final weights and optimizer state to ``ROOT/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from test_data_resume import IdRegressor, Samples
from torch.utils.data import DataLoader

import torchrig


class Recorder(IdRegressor):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        with open(self.root / f"rank{self.trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(self.trained[-1]) + "\n")
        return loss


class TermAt(torchrig.Callback):
    """The last rank sends itself SIGTERM after the first step of ``steps`` past the resumed one."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def on_fit_start(self, trainer: Any, module: Any) -> None:  # after the resume
        self.steps = [s for s in self.steps if s > trainer.global_step][:1]

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step in self.steps and trainer.global_rank == trainer.world_size - 1:
            self.steps = []
            os.kill(os.getpid(), signal.SIGTERM)


def fit(root: Path, term_at: list[int], async_save: bool, devices: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    module = Recorder(root)
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", seed=7, max_epochs=2,
        accumulate_grad_batches=2, val_check_interval=3, num_sanity_val_steps=0, deterministic=True,
        enable_progress_bar=False, enable_model_summary=False, logger=False, default_root_dir=root,
        callbacks=[
            TermAt(term_at),
            torchrig.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_last=True, async_save=async_save),
        ],
    )  # fmt: skip
    train = DataLoader(Samples(96), batch_size=4 // devices, shuffle=True)  # 24 batches an epoch: 12 steps
    trainer.fit(module, train, DataLoader(Samples(8), batch_size=4))
    if trainer.is_global_zero:
        weights = {k: v.clone() for k, v in module.state_dict().items()}
        torch.save({"weights": weights, "optimizer": trainer.optimizers[0].state_dict()}, root / "final.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--term-at", default="")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    fit(args.root, [int(s) for s in args.term_at.split(",") if s], args.async_save, args.devices)


if __name__ == "__main__":
    main()
