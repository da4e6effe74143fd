"""What ``torchrig demo`` does: train the digits CNN with the Trainer, test it, plot it, report it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchrig.arguments import directory, int_in_range
from torchrig.checkpoint.entries import module_counts
from torchrig.checkpoint.files import resolve_checkpoint
from torchrig.checkpoint.meta import epoch_text
from torchrig.checkpoint.reading import read_meta
from torchrig.demo.data import DigitsDataModule
from torchrig.demo.model import DigitsCNN
from torchrig.demo.plot import plot_learning_curves
from torchrig.devices import device_module
from torchrig.trainer import Callback, ModelCheckpoint, Trainer, TrainingModule
from torchrig.trainer.checkpointing import CHECKPOINTS, newest_run_with_last
from torchrig.trainer.loggers import CSVLogger, discarded_on_failure, next_version_dir

#: Runs live in ``<root_dir>/<RUN_NAME>/version_N``.
RUN_NAME = "digits"


@dataclass(frozen=True)
class DemoResult:
    """What a demo run measured and where it wrote."""

    run_dir: Path
    device: str
    processes: int
    strategy: str
    precision: str
    test_accuracy: float
    test_loss: float
    test_images: int
    first_epoch: int | None
    epochs: int
    spawned: bool
    fit_seconds: float
    total_seconds: float
    png: Path | None


class _FirstEpoch(Callback):
    """Remembers the first epoch this fit trains (later than 0 when it resumed); None if none.

    In a resumed run it also says where the run continues and at which learning rate, at the
    epoch's first batch: the module's ``on_train_epoch_start`` (called after the callbacks', as in
    Lightning) has set it for this epoch and the new horizon by then.
    """

    def __init__(self, resumed: bool = False) -> None:
        self.epoch: int | None = None
        self.resumed = resumed

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        if self.epoch is not None:
            return
        self.epoch = trainer.current_epoch
        if self.resumed:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            trainer.rig.print(
                f"torchrig demo: resumed after {self.epoch} epoch{'' if self.epoch == 1 else 's'} "
                f"(step {trainer.global_step}); epoch {epoch_text(self.epoch, trainer.max_epochs)} starts at learning "
                f"rate {lr:.3g}"
            )


def latest_run(root_dir: str | os.PathLike[str]) -> Path | None:
    """The newest ``version_N`` under ``root_dir/digits`` that has a ``last`` checkpoint, or None."""
    return newest_run_with_last(Path(root_dir) / RUN_NAME)


def _choose_run_dir(root_dir: Path, resume: bool) -> Path:
    """A new run directory, or (``resume``) the previous run's, to continue in place."""
    if not resume:
        return next_version_dir(root_dir / RUN_NAME)
    previous = latest_run(root_dir)
    if previous is None:
        raise ValueError(
            f"--resume continues the newest run under {root_dir / RUN_NAME}, but there is none with a "
            f"checkpoint ({root_dir / RUN_NAME}/version_N/{CHECKPOINTS}/last); run `torchrig demo` first, "
            "or pass the --root-dir of an earlier run"
        )
    return previous


def _attach_run_dir(trainer: Trainer, root_dir: Path, resume: bool) -> Path:
    """Pick the run directory once (rank zero) and give every process the same logger and checkpoints."""
    launched_later = trainer.rig.strategy.needs_launch
    run_dir = _choose_run_dir(root_dir, resume) if trainer.is_global_zero or launched_later else None
    if not launched_later:  # the processes exist already: rank zero's choice is everyone's
        run_dir = trainer.rig.broadcast(run_dir)
    if run_dir is None:  # only when a broadcast misbehaves; every rank has rank zero's path
        raise RuntimeError("the demo's run directory did not reach this process")
    logger = CSVLogger(root_dir=root_dir, name=RUN_NAME, version=run_dir.name)
    logger.attach(trainer)
    trainer.loggers.append(logger)
    trainer.callbacks.append(ModelCheckpoint(dirpath=run_dir / CHECKPOINTS, save_last=True))
    return run_dir


#: The settings a checkpoint's meta.json records that a resumed demo run compares with its own.
_RESUMED_SETTINGS = (("precision", "precision"), ("device_type", "device"), ("world_size", "processes"))


def _saved_settings(root_dir: Path) -> dict[str, Any]:
    """What the newest run's ``last`` checkpoint was saved with (its meta.json); {} if no run."""
    previous = latest_run(root_dir)
    if previous is None:
        return {}  # _choose_run_dir says what is missing
    meta = read_meta(resolve_checkpoint(previous / CHECKPOINTS / "last"))
    return {key: meta.get(key) for key, _ in _RESUMED_SETTINGS}


def _settings_changed(saved: dict[str, Any], trainer: Trainer) -> list[str]:
    """The settings of this run that differ from those the resumed checkpoint was saved with."""
    rig = trainer.rig
    now: dict[str, Any] = {"precision": rig.precision.name, "device_type": rig.device.type}
    now["world_size"] = rig.world_size
    return [
        f"{name} {now[key]} (the checkpoint was saved with {saved[key]})"
        for key, name in _RESUMED_SETTINGS
        if saved.get(key) is not None and saved[key] != now[key]
    ]


def device_description(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)``, or just ``cpu`` where the device has no name."""
    if device.type == "cpu":
        return "cpu"
    get_name = getattr(device_module(device.type), "get_device_name", None)
    try:
        name = get_name(device) if get_name is not None else None
    except Exception:  # a backend whose device_name fails for this device
        name = None
    if not name:
        return str(device)
    return f"{device} ({name})"


def _announce(model: DigitsCNN, data: DigitsDataModule, run_dir: Path) -> None:
    data.setup("fit")
    splits = data.loaded()
    print(
        f"torchrig demo: {type(model).__name__} ({module_counts([model])['parameters']:,} parameters) "
        f"learns {len(splits.train):,} handwritten digits, validates on {len(splits.val)}, "
        f"tests on {len(splits.test)} held out; run directory {run_dir}"
    )


@contextlib.contextmanager
def _cpu_threads(trainer: Trainer) -> Iterator[None]:
    """One intra-op thread on the CPU unless the user chose (``OMP_NUM_THREADS``); restored after.

    The model is tiny: splitting an 8x8 convolution across threads costs more than it saves,
    and many times more when the cores are shared (measured on 2 busy cores: 26 ms a step on
    one thread, 212 ms on two).
    """
    before = torch.get_num_threads()
    if trainer.rig.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_demo(
    *,
    accelerator: Any = "auto",
    devices: Any = 1,
    strategy: Any = "auto",
    precision: Any = "auto",
    max_epochs: int = 10,
    root_dir: str | os.PathLike[str] = "runs/demo",
    resume: bool = False,
    seed: int = 0,
    plot: bool = True,
    started: float | None = None,
) -> DemoResult | None:
    """Train, validate each epoch, test, plot; returns the result on global rank zero (None elsewhere).

    ``started`` is when the clock of ``total_seconds`` started (``time.perf_counter``; default now).

    Example:
        >>> # result = run_demo(max_epochs=2, root_dir="/tmp/demo"); result.test_accuracy
    """
    started = time.perf_counter() if started is None else started
    int_in_range("max_epochs", max_epochs, 1, hint=" (--max-epochs: how many epochs to train)")
    root = Path(directory("root_dir", root_dir, hint=" (--root-dir: where the runs are written)"))
    saved = _saved_settings(root) if resume else {}
    if precision == "auto" and saved.get("precision"):  # a resumed run keeps its precision unless told
        precision = saved["precision"]
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_epochs=max_epochs,
        log_every_n_steps=10,  # an epoch is 20 steps on one process: the curves get step rows too
        default_root_dir=root,
        logger=False,  # attached below, once every process agrees on the run directory
        enable_checkpointing=False,
        seed=seed,
        enable_model_summary=False,  # its first line names the model and its parameter count
    )
    run_dir = _attach_run_dir(trainer, root, resume)
    # A new run that fails before writing anything leaves no empty version_N behind.
    with discarded_on_failure(None if resume or not trainer.is_global_zero else run_dir):
        return _train(trainer, run_dir, saved, resume=resume, seed=seed, plot=plot, started=started)


def _train(
    trainer: Trainer, run_dir: Path, saved: dict[str, Any], *, resume: bool, seed: int, plot: bool, started: float
) -> DemoResult | None:
    spawned = trainer.rig.strategy.needs_launch  # callbacks then run in the workers, not here
    first_epoch = _FirstEpoch(resumed=resume)
    trainer.callbacks.insert(0, first_epoch)
    trainer.rig.seed_everything(seed)  # before the model exists: its initial weights come from the seed
    data, model = DigitsDataModule(), DigitsCNN()
    if trainer.is_global_zero:
        _announce(model, data, run_dir)
        changed = _settings_changed(saved, trainer)
        if changed:
            print(f"torchrig demo: --resume continues with {'; '.join(changed)}")
    with _cpu_threads(trainer):
        fit_start = time.perf_counter()
        trainer.fit(model, datamodule=data, ckpt_path=(run_dir / CHECKPOINTS / "last") if resume else None)
        fit_seconds = time.perf_counter() - fit_start  # a Ctrl-C raised out of fit (last saved)
        results = trainer.test(model, datamodule=data)
    if not trainer.is_global_zero:
        return None
    png = plot_learning_curves(run_dir) if plot else None
    return DemoResult(
        run_dir=run_dir,
        device=device_description(trainer.rig.device),
        processes=trainer.rig.world_size,
        strategy=type(trainer.rig.strategy).__name__,
        precision=trainer.rig.precision.name,
        test_accuracy=results[0]["test_acc"],
        test_loss=results[0]["test_loss"],
        test_images=len(data.loaded().test),
        first_epoch=first_epoch.epoch,
        epochs=trainer.current_epoch,
        spawned=spawned,
        fit_seconds=fit_seconds,
        total_seconds=time.perf_counter() - started,
        png=png,
    )
