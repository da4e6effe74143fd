"""The learning-rate finder.

``lr_find`` trains a module for ``num_training`` optimizer steps while the learning rate grows
exponentially from ``min_lr`` to ``max_lr``, records the loss at each step, and puts everything
back as it was: the module's weights and buffers, the optimizer's state, the precision's
gradient scaler, the random number generators and the dataloader's position, bitwise. Nothing
is written: no checkpoint, no logger output, no callback runs.

Example:
    >>> # trainer = torchrig.Trainer(max_epochs=10)
    >>> # result = torchrig.tune.lr_find(trainer, module, train_dataloaders=loader)
    >>> # result.plot("lr.png"); module.lr = result.suggestion()
    >>> # trainer.fit(module, loader)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from torchrig import arguments
from torchrig.checkpoint.rng import capture_rng, restore_rng
from torchrig.trainer import stages
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.optim_config import parse_optimizers
from torchrig.tune.sweep import Restored, cycled, one_optimizer, sweep_loader, train_batch

if TYPE_CHECKING:
    from torchrig.trainer.datamodule import DataModule
    from torchrig.trainer.trainer import Trainer

#: Weight of the past in the exponentially smoothed loss (see :func:`smooth`).
SMOOTHING = 0.98

PLOT_INSTALL_HINT = "pip install matplotlib (or, in a clone of torchrig, pip install -e '.[demo]')"


class _Smoother:
    """The exponential moving average, debiased, one value at a time (see :func:`smooth`)."""

    def __init__(self, beta: float = SMOOTHING) -> None:
        self.beta, self.average, self.count = beta, 0.0, 0

    def add(self, value: float) -> float:
        self.average = self.beta * self.average + (1 - self.beta) * value
        self.count += 1
        return self.average / (1 - self.beta**self.count)


def smooth(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """The exponential moving average of ``values``, debiased: ``a_i = beta a_{i-1} + (1 - beta) v_i``,
    ``s_i = a_i / (1 - beta^(i+1))`` (``a_{-1} = 0``), so the first values are not pulled towards 0."""
    smoother = _Smoother(beta)
    return [smoother.add(v) for v in values]


@dataclass
class LRFinderResult:
    """What :func:`lr_find` measured: one entry per optimizer step it took.

    Attributes:
        lrs: the learning rate of each step.
        losses: the loss of each step (the mean over the processes).
        diverged: True when the sweep stopped early because the loss diverged (see :func:`lr_find`).
    """

    lrs: list[float]
    losses: list[float]
    diverged: bool = False

    @property
    def smoothed(self) -> list[float]:
        """The losses smoothed without lag: :func:`smooth` run forwards, then backwards over the
        result (a moving average run one way only trails the curve, which would shift the
        steepest descent towards larger learning rates)."""
        return smooth(smooth(self.losses)[::-1])[::-1]

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float:
        """The learning rate where the smoothed loss falls fastest per step of ``log(lr)``.

        The slope of :attr:`smoothed` against ``log10(lr)`` (``numpy.gradient``) is taken over the
        steps recorded, leaving out the first ``skip_begin`` and the last ``skip_end`` (where
        the loss takes off); the LR of the most negative slope is returned.

        Raises:
            ValueError: fewer than 2 steps are left after skipping.
        """
        import numpy as np

        for name, value in (("skip_begin", skip_begin), ("skip_end", skip_end)):
            arguments.int_in_range(name, value, 0)
        end = len(self.losses) - skip_end
        if end - skip_begin < 2:
            raise ValueError(
                f"the sweep recorded {len(self.losses)} steps; with skip_begin={skip_begin} and "
                f"skip_end={skip_end} fewer than 2 are left to find the steepest descent: run more steps "
                "(num_training=) or skip fewer"
            )
        loss = np.asarray(self.smoothed[skip_begin:end], dtype=np.float64)
        log_lr = np.log10(np.asarray(self.lrs[skip_begin:end], dtype=np.float64))
        return float(self.lrs[skip_begin + int(np.argmin(np.gradient(loss, log_lr)))])

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Draw the loss (raw and smoothed) against the learning rate (log scale), with the
        suggestion marked, as a PNG at ``path``; returns the path. Needs matplotlib."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError(
                f"LRFinderResult.plot needs matplotlib, which is not installed; install it with {PLOT_INSTALL_HINT}"
            ) from None
        figure = Figure(figsize=(6, 4), dpi=100, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        axes.plot(self.lrs, self.losses, alpha=0.35, label="loss")
        axes.plot(self.lrs, self.smoothed, label="smoothed loss")
        try:
            best = self.suggestion()
        except ValueError:
            best = None
        if best is not None:
            axes.axvline(best, color="red", linestyle="--", label=f"suggestion {best:.3g}")
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("loss")
        axes.grid(alpha=0.3)
        axes.legend()
        target = Path(path)
        figure.savefig(target, format="png")
        return target


def lr_find(
    trainer: Trainer,
    module: TrainingModule,
    train_dataloaders: Any = None,
    datamodule: DataModule | None = None,
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    early_stop_threshold: float | None = 4.0,
) -> LRFinderResult:
    """Sweep the learning rate exponentially and record the loss; everything is put back afterwards.

    Step ``i`` (of ``num_training``) trains one batch with the learning rate
    ``min_lr * (max_lr / min_lr) ** (i / (num_training - 1))`` set on every parameter group of
    the optimizer ``module.configure_optimizers()`` returns, through the Trainer's Rig (its
    device, strategy and precision, and its gradient clipping), cycling through the training
    data as often as needed. Schedulers, ``accumulate_grad_batches``, callbacks and loggers take
    no part; values the module logs are dropped.

    The sweep stops early when the loss diverges: when the loss smoothed so far (:func:`smooth`,
    as it runs) exceeds ``early_stop_threshold`` times its lowest value (``None``: no such
    limit), or a loss is not finite (always). To decide this the same way on every process, each step's loss
    is averaged over the processes and read on the host: one sync per step, which the finder
    accepts (it is not the training loop).

    Afterwards the module's weights and buffers, the optimizer's state (when
    ``configure_optimizers`` hands out one it keeps), the gradient scaler, the random number
    generators and the training loader's position are what they were, bitwise, so a later
    ``trainer.fit`` runs as if the sweep had not happened. The module stays prepared by the
    Trainer's Rig (as ``fit`` would leave it).

    Args:
        trainer: the Trainer whose Rig runs the sweep.
        module: the :class:`~torchrig.TrainingModule` (automatic optimization, one optimizer).
        train_dataloaders: the training DataLoader (or give ``datamodule``).
        datamodule: a :class:`~torchrig.DataModule` whose ``train_dataloader()`` is used.
        min_lr: the first learning rate (> 0).
        max_lr: the last learning rate (> ``min_lr``).
        num_training: optimizer steps of the sweep (an int >= 2).
        early_stop_threshold: stop when the smoothed loss passes this many times its lowest
            value (> 1), or ``None`` (stop only at a loss that is not finite).

    Returns:
        An :class:`LRFinderResult` (``lrs``, ``losses``, ``suggestion()``, ``plot(path)``).
    """
    check_args(min_lr, max_lr, num_training, early_stop_threshold)
    if not isinstance(module, TrainingModule):
        raise TypeError(f"lr_find() takes a torchrig.TrainingModule, got {type(module).__name__}")
    sweep = Sweep(float(min_lr), float(max_lr), int(num_training), early_stop_threshold)
    found = stages.launch(trainer, _run_lr_find, module, module, train_dataloaders, datamodule, sweep)
    return cast(LRFinderResult, found)


@dataclass
class Sweep:
    min_lr: float
    max_lr: float
    num_training: int
    threshold: float | None

    def lr(self, i: int) -> float:
        return self.min_lr * (self.max_lr / self.min_lr) ** (i / (self.num_training - 1))


def check_args(min_lr: Any, max_lr: Any, num_training: Any, threshold: Any) -> None:
    for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a finite number > 0")
    if min_lr >= max_lr:
        raise ValueError(f"min_lr={min_lr!r} must be smaller than max_lr={max_lr!r}")
    arguments.int_in_range("num_training", num_training, 2)
    if threshold is not None and (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not math.isfinite(threshold)
        or threshold <= 1
    ):
        raise ValueError(f"early_stop_threshold={threshold!r} must be a number > 1, or None")


def _run_lr_find(
    tr: Trainer, module: TrainingModule, train: Any, datamodule: DataModule | None, sweep: Sweep
) -> LRFinderResult:
    """What each process runs (through ``stages.launch``, so spawned strategies work too)."""
    rng = capture_rng(tr.rig.device)  # the state a later fit starts from, put back at the end
    stages.begin(tr, module, "fit")
    try:
        stages.setup(tr, module, datamodule, "fit")
        if train is None and datamodule is not None:
            train = datamodule.train_dataloader()
        if train is None:
            raise ValueError(
                "lr_find() needs training data: pass train_dataloaders= or a datamodule= with train_dataloader()"
            )
        prepared = stages.prepare_module(tr, module)
        optimizers, _ = parse_optimizers(module.configure_optimizers())
        one_optimizer("lr_find()", module, optimizers)
        # The optimizer is this sweep's own (the fit builds another from configure_optimizers()).
        # The loader is set up for the sweep only, not registered as prepared: the fit prepares
        # the same DataLoader (drawing its shuffle seed) as if the sweep never ran.
        return run_sweep(tr, prepared, tr.rig.prepare(optimizers[0]), train, sweep)
    finally:
        stages.teardown(tr, module, datamodule, "fit")
        restore_rng(rng, tr.rig.device)


def run_sweep(tr: Trainer, prepared: Any, optimizer: Any, loader: Any, sweep: Sweep) -> LRFinderResult:
    """The sweep on a module and optimizer the Trainer's Rig prepared (``loader``: a prepared
    training loader, or a DataLoader set up for the sweep only); everything is put back after it."""
    loader = sweep_loader(tr, loader)
    with Restored(tr, prepared, optimizer, loader):
        return _sweep_loop(tr, prepared, optimizer, loader, sweep)


def _sweep_loop(tr: Trainer, prepared: Any, optimizer: Any, loader: Any, sweep: Sweep) -> LRFinderResult:
    rig = tr.rig
    result = LRFinderResult(lrs=[], losses=[])
    smoother, best = _Smoother(), math.inf
    prepared.train()
    batches = cycled(loader, "lr_find()")
    for i in range(sweep.num_training):
        lr = sweep.lr(i)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = train_batch(tr, prepared, optimizer, next(batches), i, who="lr_find()")
        # One host sync per step (the finder's early stop must be decided alike on every rank).
        value = float(rig.all_reduce(loss.detach().float(), "mean") if rig.world_size > 1 else loss.detach())
        smoothed = smoother.add(value)
        result.lrs.append(lr)
        result.losses.append(value)
        best = min(best, smoothed)
        if not math.isfinite(value) or (sweep.threshold is not None and smoothed > sweep.threshold * best):
            result.diverged = True
            break
    return result
