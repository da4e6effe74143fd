"""Built-in callbacks (early stopping, checkpoints, monitors) and what happens when a run raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig.trainer.logger_base import Logger


class ListLogger(Logger):
    """Keeps what it is given; records how it was finalized."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.status: str | None = None

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.rows.append((-1, dict(params)))

    def finalize(self, status: str) -> None:
        self.status = status


class ScriptedVal(Regressor):
    """Logs ``val_metric`` values from a script, one per validation run."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = values
        self.runs = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_metric", self.values[min(self.runs, len(self.values) - 1)])

    def on_validation_epoch_end(self) -> None:
        self.runs += 1


@pytest.mark.timeout(20)
def test_early_stopping_stops_after_patience(tmp_path: Path) -> None:
    stopper = torchrig.EarlyStopping(monitor="val_metric", patience=2)
    trainer = quiet_trainer(tmp_path, max_epochs=20, callbacks=[stopper])
    trainer.fit(ScriptedVal([3.0, 2.0, 2.5, 2.1, 1.0]), loader(8), loader(4))
    assert trainer.should_stop
    assert stopper.stopped_epoch == 3 and trainer.current_epoch == 4  # epochs 0..3 ran
    assert stopper.best_score == 2.0 and "did not improve for 2 checks" in stopper.stop_reason


@pytest.mark.timeout(20)
def test_early_stopping_on_non_finite_and_missing_metric(tmp_path: Path) -> None:
    stopper = torchrig.EarlyStopping(monitor="val_metric", patience=5)
    trainer = quiet_trainer(tmp_path, max_epochs=20, callbacks=[stopper])
    trainer.fit(ScriptedVal([1.0, float("nan")]), loader(8), loader(4))
    assert stopper.stopped_epoch == 1 and "is not finite" in stopper.stop_reason
    missing = quiet_trainer(tmp_path, max_epochs=2, callbacks=[torchrig.EarlyStopping(monitor="nope")])
    with pytest.raises(ValueError, match=r"EarlyStopping\(monitor='nope'\) found no such logged metric; logged: "):
        missing.fit(ScriptedVal([1.0]), loader(8), loader(4))


@pytest.mark.timeout(30)
def test_model_checkpoint_keeps_the_top_k_and_the_last(tmp_path: Path) -> None:
    ckpt = torchrig.ModelCheckpoint(
        monitor="val_metric", mode="min", save_top_k=2, save_last=True, filename="{epoch}-{val_metric:.1f}"
    )
    trainer = quiet_trainer(tmp_path, max_epochs=5, enable_checkpointing=True, callbacks=[ckpt])
    trainer.fit(ScriptedVal([5.0, 1.0, 3.0, 2.0, 4.0]), loader(8), loader(4))
    folder = tmp_path / "checkpoints"
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    # best two: epochs 1 (1.0) and 3 (2.0); the newest (epoch 4) is kept for `last`.
    assert names == ["epoch=1-val_metric=1.0", "epoch=3-val_metric=2.0", "epoch=4-val_metric=4.0", "last"]
    assert (folder / "last").resolve().name == "epoch=4-val_metric=4.0"
    assert Path(ckpt.best_model_path).name == "epoch=1-val_metric=1.0" and ckpt.best_model_score == 1.0


@pytest.mark.timeout(20)
def test_model_checkpoint_every_n_train_steps_keeps_the_newest(tmp_path: Path) -> None:
    ckpt = torchrig.ModelCheckpoint(every_n_train_steps=3)
    trainer = quiet_trainer(tmp_path, max_steps=7, enable_checkpointing=True, callbacks=[ckpt])
    trainer.fit(Regressor(), loader(40))
    names = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert names == ["epoch=0-step=6"]  # save_top_k=1 without monitor keeps the newest only


@pytest.mark.timeout(20)
def test_the_trainer_skips_the_per_batch_hook_of_a_checkpoint_that_saves_at_epoch_ends(tmp_path: Path) -> None:
    # ModelCheckpoint overrides on_train_batch_end for every_n_train_steps; saving at epoch ends
    # (the default) it says the hook is idle, and the Trainer does not call it. The setting is
    # read at the start of each run.
    class CountingCheckpoint(torchrig.ModelCheckpoint):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.batch_ends = 0

        def on_train_batch_end(self, *args: Any) -> None:
            self.batch_ends += 1
            super().on_train_batch_end(*args)

    epochs = CountingCheckpoint()
    trainer = quiet_trainer(tmp_path / "a", max_steps=4, enable_checkpointing=True, callbacks=[epochs])
    trainer.fit(Regressor(), loader(16))
    assert epochs.batch_ends == 0 and epochs.best_model_path.endswith("epoch=0-step=4")
    steps = CountingCheckpoint(every_n_train_steps=2)
    trainer = quiet_trainer(tmp_path / "b", max_steps=4, enable_checkpointing=True, callbacks=[steps])
    trainer.fit(Regressor(), loader(16))
    assert steps.batch_ends == 4 and steps.best_model_path.endswith("epoch=0-step=4")
    steps.every_n_train_steps = None  # changed between runs: the next run skips the hook
    trainer = quiet_trainer(tmp_path / "c", max_steps=4, enable_checkpointing=True, callbacks=[steps])
    trainer.fit(Regressor(), loader(16))
    assert steps.batch_ends == 4


@pytest.mark.timeout(20)
def test_model_checkpoint_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"save_top_k=3\) ranks checkpoints by a metric; pass monitor="):
        torchrig.ModelCheckpoint(save_top_k=3)
    with pytest.raises(ValueError, match="takes every_n_train_steps or every_n_epochs, not both"):
        torchrig.ModelCheckpoint(every_n_train_steps=1, every_n_epochs=1)
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(mode='best'\); use 'min' or 'max'"):
        torchrig.ModelCheckpoint(mode="best")
    with pytest.raises(ValueError, match="enable_checkpointing=False, but a ModelCheckpoint is in callbacks"):
        quiet_trainer(tmp_path, callbacks=[torchrig.ModelCheckpoint()])
    ckpt = torchrig.ModelCheckpoint(monitor="val_acc")
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[ckpt], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"monitor='val_acc'\) found no such logged metric; logged: \['train_loss'"):
        trainer.fit(Regressor(), loader(8))


@pytest.mark.timeout(20)
def test_monitors_log_learning_rate_and_device_stats(tmp_path: Path) -> None:
    logger = ListLogger()
    lr, stats = torchrig.LearningRateMonitor(), torchrig.DeviceStatsMonitor()
    trainer = quiet_trainer(tmp_path, max_steps=4, log_every_n_steps=2, logger=logger, callbacks=[lr, stats])
    trainer.fit(Regressor(lr=0.05), loader(40))
    lr_rows = [(step, row) for step, row in logger.rows if "lr-SGD" in row]
    assert lr_rows == [(2, {"lr-SGD": 0.05}), (4, {"lr-SGD": 0.05})]
    stat_rows = [row for _, row in logger.rows if any(k.startswith("device_stats/") for k in row)]
    assert len(stat_rows) == 2 and all(isinstance(v, float) for v in stat_rows[0].values())
    assert logger.status == "success"


class Boom(Regressor):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            raise self.error
        return super().training_step(batch, batch_idx)


class Seen(torchrig.Callback):
    def __init__(self) -> None:
        self.exceptions: list[BaseException] = []

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self.exceptions.append(exception)


@pytest.mark.timeout(20)
def test_an_error_reaches_callbacks_and_loggers_then_is_raised(tmp_path: Path) -> None:
    logger, seen = ListLogger(), Seen()
    trainer = quiet_trainer(tmp_path, max_epochs=1, logger=logger, callbacks=[seen])
    with pytest.raises(RuntimeError, match="exploded"):
        trainer.fit(Boom(RuntimeError("exploded")), loader(40))
    assert [str(e) for e in seen.exceptions] == ["exploded"]
    assert logger.status == "failed"


@pytest.mark.timeout(20)
def test_keyboard_interrupt_closes_the_run_then_is_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A KeyboardInterrupt raised mid-step (not a Ctrl-C the Trainer deferred to a step's end,
    # see test_interrupt.py) saves nothing more: the weights and the data position disagree.
    logger, seen = ListLogger(), Seen()
    ckpt = torchrig.ModelCheckpoint(every_n_train_steps=1, save_last=True)
    trainer = quiet_trainer(tmp_path, max_epochs=1, logger=logger, callbacks=[seen, ckpt], enable_checkpointing=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(Boom(KeyboardInterrupt()), loader(40))
    assert trainer.interrupted and trainer.global_step == 2
    assert isinstance(seen.exceptions[0], KeyboardInterrupt) and logger.status == "interrupted"
    assert "KeyboardInterrupt: stopped the run; saved nothing now" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / "last").resolve().name == "epoch=0-step=2"
    # The checkpoint written before the interrupt is whole and loads.
    module = Regressor()
    got = quiet_trainer(tmp_path).validate(module, loader(8), ckpt_path=tmp_path / "checkpoints" / "last")
    assert got[0]["val_loss"] > 0


@pytest.mark.timeout(20)
def test_default_checkpoint_is_rate_limited_and_saves_the_end(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True)
    trainer.fit(Regressor(), loader(8))  # 3 short epochs: well under a minute
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    # Only the state at the end of the fit, named like the save at the end of epoch index 2 below
    # (epoch = the 0-based index of the last epoch trained), not by the 3 epochs counted after it.
    assert names == ["epoch=2-step=6", "last"]
    every = torchrig.ModelCheckpoint(dirpath=tmp_path / "every", save_top_k=-1, train_time_interval=0)
    quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[every]).fit(Regressor(), loader(8))
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == [
        "epoch=0-step=2",
        "epoch=1-step=4",
        "epoch=2-step=6",
    ]
    with pytest.raises(ValueError, match=r"train_time_interval=-1\) must be seconds >= 0 or None"):
        torchrig.ModelCheckpoint(train_time_interval=-1)
