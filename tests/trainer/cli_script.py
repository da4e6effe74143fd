"""A training script built on ``torchrig.cli.CLI``, run by tests/trainer/test_cli.py.

It imports ``examples/custom_accelerator.py`` so that its ``xpu_sim`` accelerator is registered
and selectable with ``--trainer.accelerator=xpu_sim``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import custom_accelerator  # noqa: F401  (defining the class registers "xpu_sim")

from torchrig.cli import CLI
from torchrig.trainer.datamodule import DataModule
from torchrig.trainer.module import TrainingModule


class Regressor(TrainingModule):
    """Fits y = 3x - 1.

    Args:
        hidden: width of the hidden layer.
        lr: SGD learning rate.
    """

    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Line(DataModule):
    """64 points of the line; validation and test use the same points.

    Args:
        n: how many points.
        batch_size: points per batch.
    """

    def __init__(self, n: int = 64, batch_size: int = 16) -> None:
        self.n, self.batch_size = n, batch_size

    def setup(self, stage: str) -> None:
        x = torch.rand(self.n, 1, generator=torch.Generator().manual_seed(0)) * 2 - 1
        self.data = TensorDataset(x, 3 * x - 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


if __name__ == "__main__":
    cli = CLI(Regressor, Line)
    result = cli.result
    if cli.subcommand == "predict":
        result = [len(batch) for batch in result]
    summary = {"subcommand": cli.subcommand, "accelerator": cli.trainer.rig.accelerator.name(), "result": result}
    print("SUMMARY " + json.dumps(summary))
