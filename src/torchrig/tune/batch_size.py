"""The batch-size finder: the largest batch size that trains without running out of memory.

Each trial sets the batch size on the module (or datamodule), asks ``train_dataloader()`` for a
loader built with it and trains ``steps_per_trial`` optimizer steps through the Trainer's Rig;
a trial that runs out of memory (``torch.OutOfMemoryError``, or the CPU allocator's "can't
allocate memory") failed. Lightning's two searches:

- ``"power"``: double the size after each trial that ran; stop at the first that fails and take
  the last that ran.
- ``"binsearch"``: double until one fails, then halve the interval between the largest that ran
  and the smallest that failed until they are neighbours; the result is reduced by ``margin``.

Afterwards the module's weights and buffers, the optimizer's state, the gradient scaler and the
random number generators are what they were, bitwise, and the batch size found is set.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from torchrig import arguments
from torchrig.checkpoint.rng import capture_rng, restore_rng
from torchrig.trainer import stages
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.optim_config import parse_optimizers
from torchrig.tune.sweep import (
    Attribute,
    Restored,
    cycled,
    loader_maker,
    one_optimizer,
    sweep_loader,
    train_batch,
)

if TYPE_CHECKING:
    from torchrig.trainer.datamodule import DataModule
    from torchrig.trainer.trainer import Trainer

MODES = ("power", "binsearch")


@dataclass(frozen=True)
class Search:
    """How to search (the arguments of :func:`scale_batch_size`, checked)."""

    mode: str = "power"
    steps_per_trial: int = 3
    init_val: int = 2
    max_trials: int = 25
    batch_arg_name: str = "batch_size"
    margin: float = 0.05
    max_val: int = 8192

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; use one of {', '.join(map(repr, MODES))}")
        arguments.int_in_range("steps_per_trial", self.steps_per_trial, 1)
        arguments.int_in_range("init_val", self.init_val, 1)
        arguments.int_in_range("max_trials", self.max_trials, 1)
        arguments.int_in_range("max_val", self.max_val, 1)
        if not isinstance(self.batch_arg_name, str) or not self.batch_arg_name.isidentifier():
            raise ValueError(f"batch_arg_name={self.batch_arg_name!r} must be the name of an attribute")
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"margin={m!r} must be a number in [0, 1): the fraction binsearch's result is reduced by")


def scale_batch_size(
    trainer: Trainer,
    module: TrainingModule,
    datamodule: DataModule | None = None,
    *,
    mode: str = "power",
    steps_per_trial: int = 3,
    init_val: int = 2,
    max_trials: int = 25,
    batch_arg_name: str = "batch_size",
    margin: float = 0.05,
    max_val: int = 8192,
) -> int:
    """Find the largest batch size that trains, set it on the module (or datamodule) and return it.

    The batch size is the attribute ``batch_arg_name`` of the module, its ``hparams``, the
    datamodule or its ``hparams`` (read from the last of those that has it, written to all, as
    Lightning does); the training loader comes from the datamodule's ``train_dataloader()``,
    else the module's, asked again for each size. Trials train through the Trainer's Rig (its
    device, precision and gradient clipping), one optimizer from ``configure_optimizers()``;
    callbacks, loggers and schedulers take no part. The module stays prepared by the Rig; a later
    ``trainer.fit(module, datamodule=...)`` runs as a fit given the batch size found directly.

    Args:
        trainer: the Trainer whose Rig runs the trials (one process: an out-of-memory error in
            one process of several would leave the others waiting in a collective).
        module: the :class:`~torchrig.TrainingModule` (automatic optimization, one optimizer).
        datamodule: a :class:`~torchrig.DataModule` whose ``train_dataloader()`` is used.
        mode: ``"power"`` or ``"binsearch"`` (see the module docstring).
        steps_per_trial: optimizer steps per batch size tried.
        init_val: the first batch size tried.
        max_trials: how many times the batch size may grow (trials that ran).
        batch_arg_name: the attribute that holds the batch size.
        margin: ``"binsearch"`` only: the result is reduced by this fraction (kept >= 1).
        max_val: the largest batch size tried.

    Raises:
        ValueError: no attribute ``batch_arg_name``, no ``train_dataloader()``, several processes.
        RuntimeError: every batch size tried ran out of memory, down to 1.
    """
    search = Search(mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin, max_val)
    if not isinstance(module, TrainingModule):
        raise TypeError(f"scale_batch_size() takes a torchrig.TrainingModule, got {type(module).__name__}")
    size = cast(int, stages.launch(trainer, _run_scale, module, module, datamodule, search))
    Attribute("scale_batch_size()", "batch_arg_name", batch_arg_name, module, datamodule).set(size)
    return size


def _run_scale(tr: Trainer, module: TrainingModule, datamodule: DataModule | None, search: Search) -> int:
    """What the process runs (through ``stages.launch``)."""
    rng = capture_rng(tr.rig.device)  # the state a later fit starts from, put back at the end
    stages.begin(tr, module, "fit")
    try:
        stages.setup(tr, module, datamodule, "fit")
        prepared = stages.prepare_module(tr, module)
        optimizers, _ = parse_optimizers(module.configure_optimizers())
        optimizer = tr.rig.prepare(one_optimizer("scale_batch_size()", module, optimizers))
        return find_batch_size(tr, "scale_batch_size()", prepared, optimizer, datamodule, search)
    finally:
        stages.teardown(tr, module, datamodule, "fit")
        restore_rng(rng, tr.rig.device)


#: What a trial of each stage runs: the loader method, the module's step.
_STAGES = {
    "fit": ("train_dataloader", "training_step"),
    "validate": ("val_dataloader", "validation_step"),
    "test": ("test_dataloader", "test_step"),
    "predict": ("predict_dataloader", "predict_step"),
}


def find_batch_size(
    tr: Trainer,
    who: str,
    prepared: Any,
    optimizer: Any,
    datamodule: DataModule | None,
    search: Search,
    stage: str = "fit",
) -> int:
    """The search on a module (and, for ``"fit"``, an optimizer) the Trainer's Rig prepared; the
    size found is set on the module (or datamodule), everything else is put back (the RNG by the
    caller). A ``"fit"`` trial trains ``steps_per_trial`` optimizer steps; a ``"validate"``,
    ``"test"`` or ``"predict"`` one runs that many batches of the stage's step, as the stage runs it."""
    if tr.rig.world_size > 1:
        raise ValueError(
            f"{who} runs in one process (as Lightning's): an out-of-memory error in one of "
            f"{tr.rig.world_size} processes would leave the others waiting in a collective; find the batch "
            "size with devices=1 and give it to the multi-process run"
        )
    module = prepared.module
    attr = Attribute(who, "batch_arg_name", search.batch_arg_name, module, datamodule)
    method, step_name = _STAGES[stage]
    make = loader_maker(who, module, datamodule, method)
    data_size: list[float] = [math.inf]
    if stage == "fit":
        step = functools.partial(train_batch, tr, prepared, optimizer, who=who)
    else:
        step = prepared.step_caller(getattr(module, step_name))

    def runs(size: int) -> bool:
        attr.set(size)
        made = make()
        if isinstance(made, (list, tuple)):
            if len(made) != 1:
                raise ValueError(f"{who} searches the batch size of one loader; {method}() returned {len(made)}")
            made = made[0]
        loader = sweep_loader(tr, made)
        data_size[0] = len(loader.dataset) if hasattr(loader.dataset, "__len__") else math.inf
        batches = cycled(loader, who)
        try:
            with contextlib.nullcontext() if stage == "fit" else tr.run.eval_context():
                for i in range(search.steps_per_trial):
                    step(next(batches), i)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            for p in prepared.parameters():  # what the failed step left behind
                p.grad = None
            del exc
            gc.collect()
            if torch.accelerator.is_available():
                torch.accelerator.empty_cache()
            tr.rig.print(f"torchrig: {who}: batch size {size} ran out of memory")
            return False
        return True

    with Restored(tr, prepared, optimizer):
        prepared.train(stage == "fit")
        largest = _search(search, runs, lambda: data_size[0], who)
    if search.mode == "binsearch" and search.margin > 0:
        largest = max(1, int(largest * (1 - search.margin)))
    attr.set(largest)
    tr.rig.print(f"torchrig: {who}: batch size {largest} ({search.batch_arg_name})")
    return largest


def _search(search: Search, runs: Any, data_size: Any, who: str) -> int:
    """Lightning's searches (see the module docstring); ``runs(size)`` trains a trial."""
    size = min(search.init_val, search.max_val)
    largest, smallest_failed, grown = 0, math.inf, 0
    while True:
        if runs(size):
            largest = size
            grown += 1
            if grown >= search.max_trials or size >= search.max_val or size >= data_size():
                break  # no more trials, the limit, or a batch holds the whole data set already
            if search.mode == "power" or math.isinf(smallest_failed):
                following = min(size * 2, search.max_val)
            else:
                following = (largest + int(smallest_failed)) // 2
        else:
            smallest_failed = size
            if largest and search.mode == "power":
                break  # the last size that ran
            if size == 1:
                raise RuntimeError(
                    f"{who}: every batch size tried ran out of memory, down to 1; free memory (a smaller model, "
                    "another precision, fewer other processes on the device) before searching"
                )
            following = (largest + size) // 2 if largest else size // 2
        if following in (largest, smallest_failed) or following == size:
            break  # neighbours: nothing left between the largest that ran and the smallest that failed
        size = following
    return largest


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device (or the CPU allocator) ran out of memory."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )
