"""Trainer contenders for ``overhead.py``: torchrig's Trainer and Lightning's, on the same loop.

Each runner builds a fresh Trainer and fits ``steps`` optimizer steps over the workload's
loader. What is timed is the per-step cost with one-time set-up and teardown left out, alike
for every contender: a timing callback reads ``_common.clock`` (this process's CPU time, the
clock of every contender in the table, the hand-written loop included) when the first epoch
starts and in ``on_fit_end``. Inside the window: every step, ``self.log``, epoch start and end,
the logger's buffered writes, the progress bar's redraws, and the checkpoint callback's
per-step and per-epoch work (with the defaults, a save falls due at most once a minute, so in
these sub-second fits it only checks the clock). Outside: ``fit()``'s set-up (moving the model,
building the optimizer, starting the bar; the hand-written loop's model and optimizer creation
is not timed either) and its teardown (the checkpoint that ``ModelCheckpoint`` writes in its
``on_fit_end``, which runs after every other callback, and the logger's final flush). The
module computes what the hand-written loop computes and also logs the loss every step
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


def _timer(base: type) -> Any:
    """A callback of the framework whose Callback class is ``base`` that times the fit loop."""

    class Timer(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.start: float | None = None
            self.seconds = 0.0

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            if self.start is None:
                self.start = clock()

        def on_fit_end(self, trainer: Any, module: Any) -> None:
            self.seconds = clock() - (self.start if self.start is not None else clock())

    return Timer()


def torchrig_trainer(w: Any) -> Runner:
    """Our Trainer with its defaults: progress bar, CSV logger, checkpointing (each epoch, plus last)."""
    return _torchrig(w, lean=False)


def torchrig_trainer_no_ckpt(w: Any) -> Runner:
    """Our Trainer with progress bar and CSV logging every step, checkpointing off."""
    return _torchrig(w, lean=False, checkpointing=False)


def torchrig_trainer_lean(w: Any) -> Runner:
    """Our Trainer with progress bar, logger and checkpointing off."""
    return _torchrig(w, lean=True)


def _torchrig(w: Any, *, lean: bool, checkpointing: bool = True) -> Runner:
    from rich.console import Console

    from torchrig.trainer.callbacks import Callback
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.progress import ProgressBar
    from torchrig.trainer.trainer import Trainer

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

    module, loader = Module(), w.loader()
    devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the runner)

    def run(steps: int) -> float:
        with _scratch_dir() as root:
            timer = _timer(Callback)
            if lean:
                extra: dict[str, Any] = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False)
                extra["callbacks"] = [timer]
            else:  # the default bar, drawing to a terminal whose output is thrown away
                extra = dict(callbacks=[ProgressBar(console=Console(file=devnull, force_terminal=True)), timer])
                extra["enable_checkpointing"] = checkpointing
            trainer = Trainer(
                accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1, default_root_dir=root, **extra
            )
            trainer.fit(module, loader)
            return timer.seconds

    return run


def lightning_trainer(w: Any) -> Runner:
    """Lightning's Trainer with its defaults (progress bar, logger, checkpointing, model summary)."""
    return _lightning(w, lean=False)


def lightning_trainer_lean(w: Any) -> Runner:
    """Lightning's Trainer with progress bar, logger, checkpointing and model summary off."""
    return _lightning(w, lean=True)


def _lightning(w: Any, *, lean: bool) -> Runner:
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
                accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1, default_root_dir=root, **extra
            )
            with (
                contextlib.redirect_stdout(devnull),
                contextlib.redirect_stderr(devnull),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")  # "num_workers is low" and similar advice
                trainer.fit(module, loader)
                return float(timer.seconds)

    return run


#: name -> contender, in the order they appear in the table.
TRAINER_CONTENDERS = {
    "torchrig Trainer": torchrig_trainer,
    "torchrig Trainer no ckpt": torchrig_trainer_no_ckpt,
    "torchrig Trainer lean": torchrig_trainer_lean,
    "Lightning Trainer": lightning_trainer,
    "Lightning Trainer lean": lightning_trainer_lean,
}
