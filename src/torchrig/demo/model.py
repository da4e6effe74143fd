"""The demo's model: a small convolutional network for 8x8 digits, as a ``TrainingModule``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchrig import arguments
from torchrig.trainer.module import TrainingModule


class DigitsCNN(TrainingModule):
    """Three 3x3 convolutions with batch norm, one 2x2 pooling, global average pooling, a linear head.

    Trained with AdamW and a cosine learning-rate decay over ``trainer.max_epochs``. The rate
    is a function of (epoch, max_epochs), set at the start of every epoch (and when a fit
    starts, for a run resumed mid-epoch), never carried over from a checkpoint: a run resumed
    with a larger ``--max-epochs`` continues the cosine re-planned over the new horizon from the
    epoch it is at. With no horizon (``max_epochs=-1``) the rate stays at its peak.
    Logs ``train_loss`` (per step and per epoch, in the progress bar), ``train_acc``,
    ``val_loss``, ``val_acc``, ``test_loss`` and ``test_acc``. Accuracies are computed on the
    device and reduced when read: no host sync per step.

    Args:
        width: channels of the first convolution (the others have twice as many).
        lr: the peak learning rate.
        weight_decay: AdamW's decoupled weight decay.

    Example:
        >>> model = DigitsCNN(width=8)
        >>> model(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, *, width: int = 16, lr: float = 5e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        arguments.int_in_range("width", width, 1, hint=" (default 16)")
        self.lr = lr
        self.weight_decay = weight_decay
        wide = 2 * width
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, wide, 3, padding=1),
            nn.BatchNorm2d(wide),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(wide, wide, 3, padding=1),
            nn.BatchNorm2d(wide),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(wide, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def _loss_and_accuracy(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        return loss, accuracy, len(y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, accuracy, n = self._loss_and_accuracy(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=n)
        self.log("train_acc", accuracy, on_step=False, on_epoch=True, batch_size=n)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, accuracy, n = self._loss_and_accuracy(batch)
        self.log("val_loss", loss, batch_size=n, sync_dist=True)
        self.log("val_acc", accuracy, prog_bar=True, batch_size=n, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, accuracy, n = self._loss_and_accuracy(batch)
        self.log("test_loss", loss, batch_size=n, sync_dist=True)
        self.log("test_acc", accuracy, batch_size=n, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # No LR scheduler: the rate is set from the epoch and the horizon in the hooks below.
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def on_train_start(self) -> None:
        self._set_learning_rate()  # a fit resumed mid-epoch starts without on_train_epoch_start

    def on_train_epoch_start(self) -> None:
        self._set_learning_rate()

    def _set_learning_rate(self) -> None:
        trainer = self.trainer
        rate = self.lr * cosine_factor(trainer.current_epoch, trainer.max_epochs)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = rate


def cosine_factor(epoch: int, total: int | None) -> float:
    """The share of the peak learning rate at ``epoch`` of ``total``: 1 at 0, near 0 at the end.

    The cosine is planned over ``total`` epochs as they are now: ask again with a new total and
    the answer is the same curve stretched to it. ``total`` of -1 or None (no end): always 1.

    Example:
        >>> cosine_factor(0, 10), round(cosine_factor(5, 10), 2), cosine_factor(7, -1)
        (1.0, 0.5, 1.0)
    """
    if total is None or total < 0:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(epoch, total) / max(total, 1)))
