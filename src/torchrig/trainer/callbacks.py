"""The Callback base: the events a Trainer emits, in the order it emits them.

| event                    | when                                                      |
|--------------------------|-----------------------------------------------------------|
| on_fit_start             | after set-up, before the first (sanity) validation/epoch  |
| on_train_epoch_start     | before the first batch of each training epoch             |
| on_train_batch_end       | after each optimizer step (or accumulation micro-batch)   |
| on_train_epoch_end       | after the last batch of each training epoch               |
| on_eval_start            | before validate/test/predict/sanity loops (``stage``)     |
| on_eval_batch_end        | after each evaluation batch                               |
| on_eval_end              | after an evaluation loop, metrics computed                |
| on_validation_end        | after validation metrics are computed (checkpointing, early stopping) |
| on_save_checkpoint       | a checkpoint dict is being written: add your state        |
| on_load_checkpoint       | a checkpoint dict was read: restore your state            |
| on_exception             | the run raised (including KeyboardInterrupt)              |
| on_fit_end               | the fit finished (also after early stopping)              |

Every method does nothing by default; override the ones you need. ``state_dict`` /
``load_state_dict`` let a callback's state travel in checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


class Callback:
    """Base class of Trainer callbacks (see the module docstring for the events).

    Example:
        >>> class PrintEpoch(Callback):
        ...     def on_train_epoch_end(self, trainer, module):
        ...         print("epoch", trainer.current_epoch, "done")
    """

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None: ...

    def on_eval_batch_end(
        self, trainer: Trainer, module: TrainingModule, stage: str, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None: ...

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None: ...

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None: ...

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint (class name, unique per type)."""
        return type(self).__qualname__
