"""``DataModule``: the dataloaders of a run, in one object."""

from __future__ import annotations

from typing import Any

from torchrig.trainer.hooks import BatchTransferHooks


class DataModule(BatchTransferHooks):
    """Groups the data a run needs. Override the dataloaders you use.

    ``setup(stage)`` runs in every process before the loaders are asked for (``stage`` is
    ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``): build or split datasets there.
    ``on_before_batch_transfer``, ``transfer_batch_to_device`` and ``on_after_batch_transfer``
    are called as the module's are; one a datamodule overrides is used instead of the module's.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> class Ones(DataModule):
        ...     def setup(self, stage):
        ...         self.data = TensorDataset(torch.ones(8, 4), torch.ones(8, 1))
        ...     def train_dataloader(self):
        ...         return DataLoader(self.data, batch_size=4, shuffle=True)
    """

    def prepare_data(self) -> None:
        """Download or write data once per machine (local rank 0, before ``setup``; the others wait)."""

    def setup(self, stage: str) -> None:
        """Prepare datasets for ``stage`` (called in every process)."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` took."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader()")

    def val_dataloader(self) -> Any:
        """Validation loader(s); by default none (fit then skips validation)."""
        return None

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no test_dataloader()")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no predict_dataloader()")

    def state_dict(self) -> dict[str, Any]:
        """What a fit's checkpoints keep of this datamodule (saved when overridden)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave, when a fit resumes from a checkpoint holding it."""
