"""The Trainer's quick-debugging switches: ``fast_dev_run``, ``overfit_batches``, ``detect_anomaly``.

Each is worked out once, when the Trainer is built (or once per fit): nothing here runs per step.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from torchrig import arguments
from torchrig.data import loader_kwargs
from torchrig.trainer.checkpointing import ModelCheckpoint

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer

_FAST_DEV_RUN = "; give True (1 batch), False, or an int number of batches >= 1"


def fast_dev_run_batches(value: Any) -> int:
    """The batches per loop ``fast_dev_run`` asks for: 0 when off, 1 for True, else the int given."""
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int):
        raise TypeError(f"fast_dev_run={arguments.shown(value)} must be a bool or an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"fast_dev_run={arguments.shown(value)} is negative{_FAST_DEV_RUN}")
    return value


def configure(
    tr: Trainer, fast_dev_run: Any, overfit_batches: int | float, detect_anomaly: Any
) -> tuple[int, int | float, bool]:
    """Apply the debugging switches to the Trainer's settings (``overfit_batches`` already checked
    as a limit); returns the checked ``fast_dev_run`` (batches, 0: off), ``overfit_batches`` and
    ``detect_anomaly``.

    ``fast_dev_run=N``: every loop runs N batches (validation, test and predict too), in one
    epoch, without the sanity check; the loggers and every ``ModelCheckpoint`` are left out, so
    nothing is written to disk. ``overfit_batches=N``: each training epoch (and validation run)
    uses the first N batches (a float: that fraction of them), the training loader unshuffled, so
    every epoch sees the same batches.
    """
    if not isinstance(detect_anomaly, bool):
        raise TypeError(f"detect_anomaly={arguments.shown(detect_anomaly)} must be True or False")
    batches = fast_dev_run_batches(fast_dev_run)
    if batches and overfit_batches:
        raise ValueError(
            f"fast_dev_run={arguments.shown(fast_dev_run)} and overfit_batches={arguments.shown(overfit_batches)} "
            "both limit the batches; give one"
        )
    if overfit_batches:
        tr.limit_train_batches = tr.limit_val_batches = overfit_batches
    if not batches:
        return 0, overfit_batches, detect_anomaly
    tr.limit_train_batches = tr.limit_val_batches = batches
    tr.limit_test_batches = tr.limit_predict_batches = batches
    tr.max_epochs, tr.max_steps = 1, -1
    tr.num_sanity_val_steps, tr.val_check_interval, tr.check_val_every_n_epoch = 0, 1.0, 1
    tr.loggers = []
    tr.callbacks = [cb for cb in tr.callbacks if not isinstance(cb, ModelCheckpoint)]
    plural = "es" if batches > 1 else ""
    tr.rig.print(
        f"torchrig: fast_dev_run={arguments.shown(fast_dev_run)}: {batches} batch{plural} of each loop, 1 epoch; "
        "no checkpoints or logs are written"
    )
    return batches, overfit_batches, detect_anomaly


def train_loader(tr: Trainer, loader: Any) -> Any:
    """The training loader a fit uses: under ``overfit_batches`` a shuffling ``DataLoader`` is
    rebuilt with a sequential sampler (every epoch the same first batches)."""
    if (
        not tr.overfit_batches
        or not isinstance(loader, DataLoader)
        or not isinstance(loader.sampler, RandomSampler)
        or type(loader.batch_sampler) is not BatchSampler  # a custom batch sampler orders its own batches
    ):
        return loader
    batch_size, drop_last = loader.batch_sampler.batch_size, loader.batch_sampler.drop_last
    kwargs = loader_kwargs(loader)  # workers, collate_fn, pinning... as given
    sampler = SequentialSampler(loader.dataset)  # type: ignore[arg-type]
    return DataLoader(loader.dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)


def anomaly_detection(tr: Trainer) -> contextlib.AbstractContextManager[Any]:
    """``torch.autograd.set_detect_anomaly(True)`` for a fit with ``detect_anomaly=True``."""
    return torch.autograd.set_detect_anomaly(True) if tr.detect_anomaly else contextlib.nullcontext()
