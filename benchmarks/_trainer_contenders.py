"""Trainer contenders for ``overhead.py``: torchrig's Trainer and Lightning's, on the same loop.

Each runner builds a fresh Trainer and fits ``steps`` optimizer steps (at least 4 epochs) over
the workload's loader. What is timed is the steady-state cost of a step, alike for every
contender: a timing callback reads ``_common.clock`` (this process's CPU time, the clock of
every contender in the table, the hand-written loop included) at the start of each epoch, and
the runner reports the time from the start of the second epoch to the start of the last one,
scaled to ``steps`` steps. Inside that window: every step, ``self.log``, the whole of each
epoch's start and end (every callback's and the module's hooks, the logger's buffering, the
checkpoint callback's checks), the progress bar's redraws at its real rate, and the writing
of every row logged in the window (our logger writes every 10 s, so the timer makes it write
the window's rows at the window's end, inside it, see :func:`_timer`; a flush's fixed cost is
then charged once per window, far more often than in a real run). Outside:
``fit()``'s set-up and first epoch (moving the model, building the optimizer, starting the bar
and its first draw) and the last epoch with the teardown (the final redraw, the checkpoint
``ModelCheckpoint`` writes at the end of every fit, the logger's last flush): one-time costs
that a sub-second benchmark fit would otherwise charge to its few hundred steps. The module
computes what the hand-written loop computes and also logs the loss every step
(``log_every_n_steps=1``), which the hand-written loop does not: that cost is part of what the
Trainer is charged for. Progress bars draw to a discarded terminal, so their real rendering
cost is paid without filling the benchmark's output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from _common import Runner, clock


@contextlib.contextmanager
def _scratch_dir() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="torchrig-bench-")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _timer(base: type, flush_epochs: int | None = None) -> Any:
    """A callback of the framework whose Callback class is ``base`` that reads the clock at
    every epoch start; :func:`_steady` turns that into the time of the steps in between.

    With ``flush_epochs`` (the fit's number of epochs) it also makes our loggers write what they
    buffered, once just before the timed window (the first epoch's rows, not charged) and once
    at its end, inside it: the rows of the timed steps are then converted and written within
    the window, as a 10 s flush would in a longer run, instead of at the end of the fit.
    """

    class Timer(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.starts: list[float] = []

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            if flush_epochs is not None and len(self.starts) in (1, flush_epochs - 1):
                for logger in trainer.loggers:
                    logger.flush()
            self.starts.append(clock())

    return Timer()


def _steady(timer: Any, w: Any, steps: int) -> float:
    """Seconds for ``steps`` steps at the rate of the epochs between the first and the last."""
    starts = timer.starts
    if len(starts) < 4:
        raise ValueError(f"the timed window needs >= 4 epochs; {steps} steps of {w.batches} batches give {len(starts)}")
    per_epoch = (starts[-1] - starts[1]) / (len(starts) - 2)
    return per_epoch * steps / w.batches


def torchrig_trainer(w: Any) -> Runner:
    """Our Trainer with its defaults: progress bar, CSV logger, checkpointing (each epoch, plus last)."""
    return _torchrig(w)


def torchrig_trainer_every_50(w: Any) -> Runner:
    """Our Trainer with all its defaults, its logging interval (50 steps) included: the loss is
    still logged by ``self.log`` every step and shown by the bar, the CSV gets every 50th."""
    return _torchrig(w, log_every_n_steps=50)


def torchrig_trainer_no_ckpt(w: Any) -> Runner:
    """Our Trainer with progress bar and CSV logging every step, checkpointing off."""
    return _torchrig(w, checkpointing=False)


def torchrig_trainer_lean(w: Any) -> Runner:
    """Our Trainer with progress bar, logger and checkpointing off."""
    return _torchrig(w, bar=False, logger=False, checkpointing=False)


def torchrig_module(w: Any) -> Any:
    """Our TrainingModule computing what the hand-written loop computes, logging the loss every step."""
    from torchrig.trainer.module import TrainingModule

    class Module(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return w.optimizer(self.net)

    return Module()


def torchrig_fit(
    module: Any,
    loader: Any,
    *,
    steps: int,
    callbacks: list[Any],
    bar: bool,
    logger: bool,
    checkpointing: bool,
    profiler: str | None = None,
    log_every_n_steps: int = 1,
) -> None:
    """``fit`` ``steps`` steps with the default bar (drawing to a terminal whose output is thrown
    away), CSV logger and checkpointing each on or off, in a scratch directory; what the fit
    prints (the model summary at its start, a profiler's report at its end) is thrown away too."""
    from rich.console import Console

    from torchrig.trainer.progress import ProgressBar
    from torchrig.trainer.trainer import Trainer

    with _scratch_dir() as root, open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        if bar:
            callbacks = [ProgressBar(console=Console(file=devnull, force_terminal=True)), *callbacks]
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            log_every_n_steps=log_every_n_steps,
            default_root_dir=root,
            callbacks=callbacks,
            enable_progress_bar=bar,
            logger=logger,
            enable_checkpointing=checkpointing,
            profiler=profiler,
        )
        trainer.fit(module, loader)


def _torchrig(
    w: Any,
    *,
    bar: bool = True,
    logger: bool = True,
    checkpointing: bool = True,
    charge_flush: bool = True,
    profiler: str | None = None,
    log_every_n_steps: int = 1,
) -> Runner:
    """Our Trainer with the default bar, CSV logger and checkpointing each on or off; with
    ``charge_flush=False`` the rows logged in the timed window are written after it; ``profiler``
    as ``Trainer(profiler=...)`` (its report, after the fit, is outside the window)."""
    from torchrig.trainer.callbacks import Callback

    module, loader = torchrig_module(w), w.loader()

    def run(steps: int) -> float:
        timer = _timer(Callback, flush_epochs=steps // w.batches if charge_flush else None)
        torchrig_fit(
            module,
            loader,
            steps=steps,
            callbacks=[timer],
            bar=bar,
            logger=logger,
            checkpointing=checkpointing,
            profiler=profiler,
            log_every_n_steps=log_every_n_steps,
        )
        return _steady(timer, w, steps)

    return run


def lightning_trainer(w: Any) -> Runner:
    """Lightning's Trainer with its defaults (progress bar, logger, checkpointing, model summary)."""
    return _lightning(w, lean=False)


def lightning_trainer_every_50(w: Any) -> Runner:
    """Lightning's Trainer with all its defaults, its logging interval (50 steps) included."""
    return _lightning(w, lean=False, log_every_n_steps=50)


def lightning_trainer_lean(w: Any) -> Runner:
    """Lightning's Trainer with progress bar, logger, checkpointing and model summary off."""
    return _lightning(w, lean=True)


def _lightning(w: Any, *, lean: bool, log_every_n_steps: int = 1) -> Runner:
    import lightning.pytorch as pl

    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: False" and tips, per fit
        logging.getLogger(name).setLevel(logging.WARNING)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return w.optimizer(self.net)

    module, loader = Module(), w.loader()
    devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the runner)

    def run(steps: int) -> float:
        with _scratch_dir() as root:
            timer = _timer(pl.Callback)
            extra: dict[str, Any] = {"callbacks": [timer]}
            if lean:
                extra.update(enable_progress_bar=False, logger=False, enable_checkpointing=False)
                extra["enable_model_summary"] = False
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=steps,
                log_every_n_steps=log_every_n_steps,
                default_root_dir=root,
                **extra,
            )
            with (
                contextlib.redirect_stdout(devnull),
                contextlib.redirect_stderr(devnull),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")  # "num_workers is low" and similar advice
                trainer.fit(module, loader)
                return _steady(timer, w, steps)

    return run


#: Our Trainer taken apart: each of the defaults' parts alone (``overhead.py --suite trainer-parts``).
TRAINER_PARTS = {
    "torchrig Trainer lean": torchrig_trainer_lean,
    "bar only": lambda w: _torchrig(w, logger=False, checkpointing=False),
    "checkpointing only": lambda w: _torchrig(w, bar=False, logger=False),
    "logger only": lambda w: _torchrig(w, bar=False, checkpointing=False),
    "logger only, window's rows written after it": lambda w: _torchrig(
        w, bar=False, checkpointing=False, charge_flush=False
    ),
    "torchrig Trainer": torchrig_trainer,
    # The defaults with profiler="simple": every phase of every step timed (its cost, not a default's).
    "torchrig Trainer, simple profiler": lambda w: _torchrig(w, profiler="simple"),
}

#: name -> contender, in the order they appear in the table.
TRAINER_CONTENDERS = {
    "torchrig Trainer": torchrig_trainer,
    "torchrig Trainer, log every 50 steps (default)": torchrig_trainer_every_50,
    "torchrig Trainer no ckpt": torchrig_trainer_no_ckpt,
    "torchrig Trainer lean": torchrig_trainer_lean,
    "Lightning Trainer": lightning_trainer,
    "Lightning Trainer, log every 50 steps (default)": lightning_trainer_every_50,
    "Lightning Trainer lean": lightning_trainer_lean,
}
