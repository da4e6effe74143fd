"""``BasePredictionWriter``: write predictions where they are made (Lightning's callback).

On many processes ``trainer.predict`` gathers every process's outputs into each process: for
large outputs, write them instead, each process its own share, and pass
``return_predictions=False`` so nothing is gathered. Subclass and implement
:meth:`BasePredictionWriter.write_on_batch_end` (``write_interval="batch"``),
:meth:`BasePredictionWriter.write_on_epoch_end` (``"epoch"``), or both (``"batch_and_epoch"``).
``batch_indices`` are the dataset indices of this process's samples, in the batch's order, so
the files of all processes can be put back in dataset order (a sample the sampler repeated to
even out the processes appears twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrig.trainer.callbacks import Callback, EventSchedule

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Write predictions per batch and/or once per predict run, on every process.

    Example:
        >>> import torch
        >>> class Writer(BasePredictionWriter):
        ...     def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx,
        ...                            dataloader_idx):
        ...         torch.save(prediction, f"pred-{trainer.global_rank}-{batch_idx}.pt")
        >>> # trainer.predict(module, loader, return_predictions=False)  # with callbacks=[Writer()]
    """

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise ValueError(f"write_interval={write_interval!r}; use one of {', '.join(map(repr, _INTERVALS))}")
        self.write_interval = write_interval
        self._predictions: list[list[Any]] = []
        self._indices: list[list[list[int]]] = []

    def write_on_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        prediction: Any,
        batch_indices: list[int],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's predictions (``write_interval`` ``"batch"`` or ``"batch_and_epoch"``)."""
        raise NotImplementedError(f"{type(self).__name__} writes per batch: implement write_on_batch_end")

    def write_on_epoch_end(
        self, trainer: Trainer, module: TrainingModule, predictions: list[list[Any]], batch_indices: list[list[Any]]
    ) -> None:
        """Write this process's predictions of the whole run: per loader, per batch
        (``write_interval`` ``"epoch"`` or ``"batch_and_epoch"``)."""
        raise NotImplementedError(f"{type(self).__name__} writes per epoch: implement write_on_epoch_end")

    def event_schedule(self, event: str) -> EventSchedule:
        return EventSchedule(enabled=event in ("on_eval_start", "on_eval_batch_end", "on_eval_end"))

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "predict":
            self._predictions, self._indices = [], []

    def on_eval_batch_end(
        self, trainer: Trainer, module: TrainingModule, stage: str, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if stage != "predict":
            return
        run = trainer.run
        loader_idx, indices = run.predict_dataloader_idx, list(run.predict_batch_indices)
        if self.write_interval != "epoch":
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, loader_idx)
        if self.write_interval != "batch":
            while len(self._predictions) <= loader_idx:
                self._predictions.append([])
                self._indices.append([])
            self._predictions[loader_idx].append(outputs)
            self._indices[loader_idx].append(indices)

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "predict" and self.write_interval != "batch":
            predictions, indices = self._predictions, self._indices
            self._predictions, self._indices = [], []
            self.write_on_epoch_end(trainer, module, predictions, indices)
