"""Tuning tools: the learning-rate finder and the batch-size finder.

``lr_find`` trains a module for ``num_training`` optimizer steps while the learning rate grows
exponentially from ``min_lr`` to ``max_lr``, records the loss at each step, and puts everything
back as it was: the module's weights and buffers, the optimizer's state, the precision's
gradient scaler, the random number generators and the dataloader's position, bitwise. Nothing
is written: no checkpoint, no logger output, no callback runs.

``scale_batch_size`` trains a few steps at growing batch sizes until one runs out of memory and
sets the largest that ran on the module (or datamodule), putting everything else back the same way.

Their callbacks, :class:`~torchrig.LearningRateFinder` and :class:`~torchrig.BatchSizeFinder`,
run them at the start of a fit.

Example:
    >>> # trainer = torchrig.Trainer(max_epochs=10)
    >>> # result = torchrig.tune.lr_find(trainer, module, train_dataloaders=loader)
    >>> # result.plot("lr.png"); module.lr = result.suggestion()
    >>> # torchrig.tune.scale_batch_size(trainer, module, datamodule=data)  # sets data.batch_size
    >>> # trainer.fit(module, datamodule=data)
"""

from __future__ import annotations

from torchrig.tune.batch_size import scale_batch_size
from torchrig.tune.lr_finder import SMOOTHING, LRFinderResult, lr_find, smooth

__all__ = ["SMOOTHING", "LRFinderResult", "lr_find", "scale_batch_size", "smooth"]
