"""The demo's data: scikit-learn's handwritten digits, split once, normalised by the training split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchrig import arguments
from torchrig.demo import require_extras
from torchrig.trainer.datamodule import DataModule


@dataclass(frozen=True)
class DigitsSplits:
    """The three parts of the digits data set and the statistics used to normalise them."""

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    mean: float
    std: float


def load_digit_splits(*, split_seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.2) -> DigitsSplits:
    """``sklearn.datasets.load_digits`` as stratified train/validation/test ``TensorDataset`` s.

    Images are ``(1, 8, 8)`` float32, shifted and scaled by the mean and standard deviation of
    the training split only (the validation and test pixels never inform the model). The
    split depends on ``split_seed`` alone, so runs with different training seeds are tested on
    the same held-out images.

    Example:
        >>> splits = load_digit_splits()
        >>> len(splits.train), len(splits.val), len(splits.test)
        (1257, 180, 360)
    """
    if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} must each be in (0, 1) "
            "and leave a training split (sum < 1)"
        )
    require_extras("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.as_tensor(digits.target, dtype=torch.long)
    index = np.arange(len(labels))
    rest, test = train_test_split(index, test_size=test_fraction, stratify=digits.target, random_state=split_seed)
    train, val = train_test_split(
        rest,
        test_size=val_fraction / (1 - test_fraction),
        stratify=digits.target[rest],
        random_state=split_seed,
    )
    mean, std = images[train].mean().item(), images[train].std().item()
    images = (images - mean) / std

    def part(rows: np.ndarray) -> TensorDataset:
        idx = torch.as_tensor(rows)
        return TensorDataset(images[idx], labels[idx])

    return DigitsSplits(train=part(train), val=part(val), test=part(test), mean=mean, std=std)


class DigitsDataModule(DataModule):
    """The digits data set as a :class:`~torchrig.trainer.datamodule.DataModule`.

    Args:
        batch_size: training batch size (evaluation uses larger batches: no gradients).
        split_seed: the seed of the train/validation/test split (fixed by default).
        val_fraction: share of all images held out for validation.
        test_fraction: share of all images held out for the final test.

    Example:
        >>> data = DigitsDataModule(batch_size=64)
        >>> data.setup("fit")
        >>> x, y = next(iter(data.train_dataloader()))
        >>> tuple(x.shape), tuple(y.shape)
        ((64, 1, 8, 8), (64,))
    """

    def __init__(
        self, *, batch_size: int = 64, split_seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.2
    ) -> None:
        arguments.int_in_range("batch_size", batch_size, 1, hint=" (default 64)")
        self.batch_size = batch_size
        self.split_seed = split_seed
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.splits: DigitsSplits | None = None

    def setup(self, stage: str) -> None:
        if self.splits is None:
            self.splits = load_digit_splits(
                split_seed=self.split_seed, val_fraction=self.val_fraction, test_fraction=self.test_fraction
            )

    def loaded(self) -> DigitsSplits:
        """The splits (an error before ``setup``)."""
        if self.splits is None:
            raise RuntimeError("DigitsDataModule.setup(stage) must run before its dataloaders are asked for")
        return self.splits

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.loaded().train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.loaded().val, batch_size=512)

    def test_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.loaded().test, batch_size=512)
