"""``ModelHooks``: the hooks of a :class:`~torchrig.TrainingModule`, with Lightning 2.6's names
and arguments (``ModelHooks``, ``DataHooks`` and ``CheckpointHooks`` there).

Each does nothing by default, except where noted; override the ones you need. A run calls a
hook only when the module overrides it (worked out once per run, see
:mod:`torchrig.trainer.callbacks` for the events table), at the moment docs/migrating.md's hook
table gives, after the callbacks' method of the same event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from torchrig.nested import move_batch

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer


class BatchTransferHooks:
    """The batch-transfer hooks, of a :class:`~torchrig.TrainingModule` or a
    :class:`~torchrig.DataModule` (a datamodule's override is used when both have one, as in Lightning)."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The batch before it moves to the device; return it (changed or not)."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move the batch to ``device``; by default every tensor in it (nested lists, dicts...)."""
        return move_batch(batch, device, device.type not in ("cpu", "mps"))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The batch on the device; return it (changed or not)."""
        return batch


class ModelHooks(BatchTransferHooks):
    """The hooks a run calls on its module (mixed into :class:`~torchrig.TrainingModule`)."""

    _trainer: Trainer | None

    # -- set-up and teardown ----------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download or write data once per machine: called on local rank 0 only, before
        ``setup``; the other processes wait for it. Don't set state here (it is not called in
        every process); do that in ``setup``."""

    def setup(self, stage: str) -> None:
        """First in every process; ``stage`` is fit/validate/test/predict."""

    def configure_model(self) -> None:
        """Build layers here (after ``setup``) to create them directly on the device, in the
        precision's dtype (inside ``rig.init_module()``); called in every run, so build only once."""

    def teardown(self, stage: str) -> None:
        """Last, also when the run raised."""

    # -- fit, validate, test, predict -------------------------------------------------------
    def on_fit_start(self) -> None: ...

    def on_fit_end(self) -> None: ...

    def on_train_start(self) -> None: ...

    def on_train_end(self) -> None: ...

    def on_train_epoch_start(self) -> None: ...

    def on_train_epoch_end(self) -> None: ...

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Before each training batch; return -1 to skip the rest of the epoch (as in Lightning)."""
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_validation_start(self) -> None: ...

    def on_validation_end(self) -> None: ...

    def on_validation_epoch_start(self) -> None: ...

    def on_validation_epoch_end(self) -> None: ...

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_test_start(self) -> None: ...

    def on_test_end(self) -> None: ...

    def on_test_epoch_start(self) -> None: ...

    def on_test_epoch_end(self) -> None: ...

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_predict_start(self) -> None: ...

    def on_predict_end(self) -> None: ...

    def on_predict_epoch_start(self) -> None: ...

    def on_predict_epoch_end(self) -> None: ...

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    # -- eval and train modes around evaluation ----------------------------------------------
    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside a fit: by default frees the gradients of the last optimizer
        step (none are freed inside an accumulation window, whose gradients are still summing)."""
        trainer = self._trainer
        if trainer is None:
            return
        done, accumulate = trainer.fit_state.batch_idx, trainer.accumulate_grad_batches
        if done % accumulate == 0 or done >= trainer.num_training_batches:
            cast(torch.nn.Module, self).zero_grad(set_to_none=True)

    def on_validation_model_eval(self) -> None:
        """Before validation (and the sanity check): by default ``self.eval()``."""
        cast(torch.nn.Module, self).eval()

    def on_validation_model_train(self) -> None:
        """After validation: by default ``self.train()``."""
        cast(torch.nn.Module, self).train()

    def on_test_model_eval(self) -> None:
        """Before a test: by default ``self.eval()``."""
        cast(torch.nn.Module, self).eval()

    def on_test_model_train(self) -> None:
        """After a test: by default ``self.train()``."""
        cast(torch.nn.Module, self).train()

    def on_predict_model_eval(self) -> None:
        """Before predicting: by default ``self.eval()``."""
        cast(torch.nn.Module, self).eval()

    # -- the optimizer step (automatic optimization) ------------------------------------------
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the gradients are zeroed: after ``training_step`` of the first batch of each
        optimizer step's window, before its backward (where Lightning zeroes them)."""

    def on_before_backward(self, loss: torch.Tensor) -> None: ...

    def on_after_backward(self) -> None:
        """After each backward (every micro-batch); the gradients are still scaled under ``16-mixed``."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before each optimizer step, before clipping; gradients are unscaled under ``16-mixed``
        only once clipping ran (as in Lightning)."""

    # -- what a step does (the overrides Lightning users write) -----------------------------
    def configure_callbacks(self) -> Any:
        """Callbacks this module brings (a callback or a list), added to the Trainer's for each
        run; one of the same type as a Trainer callback replaces it."""
        return []

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The backward of ``loss`` (already scaled under ``16-mixed``); by default ``loss.backward()``."""
        loss.backward(*args, **kwargs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Zero ``optimizer``'s gradients; by default ``optimizer.zero_grad()`` (to None)."""
        optimizer.zero_grad()

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer, optimizer_closure: Any = None
    ) -> None:
        """Step ``optimizer``; by default ``optimizer.step(closure=optimizer_closure)``.

        torchrig has run the batch's forward and backward already: ``optimizer_closure()``
        returns that loss without computing it again (optimizers that call the closure several
        times per step, such as LBFGS, are not supported), and may be left out."""
        optimizer.step(closure=optimizer_closure)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` (at its ``interval``/``frequency``); ``metric`` is the monitored value
        or None. Override it to use a scheduler that is not torch's (timm's ``CosineLRScheduler``:
        ``scheduler.step(epoch=self.trainer.current_epoch)``)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        """Clip before each optimizer step; by default ``self.clip_gradients(optimizer,
        gradient_clip_val, gradient_clip_algorithm)`` with the Trainer's settings."""
        clip = getattr(self, "clip_gradients")  # noqa: B009 (TrainingModule's)
        clip(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm or "norm")

    # -- checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint is being written: add plain entries of yours to ``checkpoint``."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint was read: ``checkpoint`` holds what ``on_save_checkpoint`` added."""
