"""``GradientAccumulationScheduler``: change ``accumulate_grad_batches`` by epoch (Lightning's callback).

``scheduling={0: 8, 4: 4, 8: 1}`` accumulates 8 batches per optimizer step in epochs 0-3, 4 in
epochs 4-7 and 1 from epoch 8 on (epochs before the first key accumulate 1). The factor is a
function of the epoch alone, so a fit resumed in any epoch (mid-epoch too) uses the factor the
uninterrupted fit used there: nothing else needs saving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrig import arguments
from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Set ``trainer.accumulate_grad_batches`` from ``scheduling`` (``{first_epoch: factor}``) as
    each epoch starts (and when a fit starts or resumes)."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise TypeError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}): give a non-empty dict "
                "{first_epoch: batches_per_step}, such as {0: 8, 4: 1}"
            )
        checked = {
            arguments.int_in_range("scheduling epoch", epoch, 0): arguments.int_in_range(
                f"scheduling[{epoch!r}]", factor, 1
            )
            for epoch, factor in scheduling.items()
        }
        self.scheduling = dict(sorted(checked.items()))

    def factor(self, epoch: int) -> int:
        """Batches per optimizer step in ``epoch``."""
        found = 1
        for first, factor in self.scheduling.items():
            if epoch >= first:
                found = factor
        return found

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not module.automatic_optimization:
            raise ValueError(
                f"GradientAccumulationScheduler sets the Trainer's accumulation, but {type(module).__name__} sets "
                "automatic_optimization = False (it steps its optimizers itself); drop the callback"
            )
        if trainer.accumulate_grad_batches != 1:  # the Trainer's own value: the schedule puts 1 back after a fit
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and a "
                "GradientAccumulationScheduler both set the accumulation; give the schedule only"
            )
        trainer.accumulate_grad_batches = self.factor(trainer.current_epoch)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        trainer.accumulate_grad_batches = self.factor(trainer.current_epoch)

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        trainer.accumulate_grad_batches = 1  # the Trainer's own value (checked to be 1) for a later fit

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        trainer.accumulate_grad_batches = 1

    def state_dict(self) -> dict[str, Any]:
        return {"scheduling": dict(self.scheduling)}
