"""CSVLogger and TensorBoardLogger: run directories, buffering without host syncs, files written."""

from __future__ import annotations

import contextlib
import csv
import pickle
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import yaml
from trainer_helpers import Regressor, loader, quiet_trainer

from torchrig.trainer.loggers import (
    CSVLogger,
    MetricBuffer,
    TensorBoardLogger,
    csv_cells,
    format_floats,
    next_version_dir,
    read_metrics,
)

pytestmark = pytest.mark.timeout(20)


def test_versions_count_up_and_concurrent_runs_get_distinct_directories(tmp_path: Path) -> None:
    first = CSVLogger(root_dir=tmp_path, name="exp")
    assert first.log_dir == tmp_path / "exp" / "version_0"
    assert CSVLogger(root_dir=tmp_path, name="exp").log_dir == tmp_path / "exp" / "version_1"
    (tmp_path / "exp" / "version_7").mkdir()
    assert CSVLogger(root_dir=tmp_path, name="exp").version == 8

    claimed: list[Path] = []
    threads = [threading.Thread(target=lambda: claimed.append(next_version_dir(tmp_path / "race"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in claimed) == [f"version_{i}" for i in range(8)]


def test_explicit_version_int_and_str(tmp_path: Path) -> None:
    assert CSVLogger(root_dir=tmp_path, version=3).log_dir == tmp_path / "torchrig_logs" / "version_3"
    assert CSVLogger(root_dir=tmp_path, version="run_a").log_dir == tmp_path / "torchrig_logs" / "run_a"


def test_csv_buffers_until_flush_every_n_steps_and_widens_the_header(tmp_path: Path) -> None:
    logger = CSVLogger(root_dir=tmp_path, flush_every_n_steps=3)
    logger.log_metrics({"loss": torch.tensor(1.5), "epoch": 0}, step=0)
    logger.log_metrics({"loss": torch.tensor(1.25), "epoch": 0}, step=1)
    assert not logger.metrics_file.exists()  # still buffered
    logger.log_metrics({"loss": torch.tensor(1.0), "epoch": 0}, step=2)  # third call: flush
    assert logger.metrics_file.read_text().splitlines() == ["step,epoch,loss", "0,0,1.5", "1,0,1.25", "2,0,1.0"]
    logger.log_metrics({"val_acc": torch.tensor(0.75), "epoch": 0}, step=2)
    logger.log_metrics({"loss": 0.5, "epoch": 1}, step=3)
    logger.finalize("success")
    with logger.metrics_file.open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "epoch", "loss", "val_acc"]  # header rewritten with the new column
    assert rows[1:] == [  # step 2's value logged after its line was written joins that line
        ["0", "0", "1.5", ""],
        ["1", "0", "1.25", ""],
        ["2", "0", "1.0", "0.75"],
        ["3", "1", "0.5", ""],
    ]
    assert read_metrics(logger.log_dir) == [
        {"step": 0, "epoch": 0, "loss": 1.5},
        {"step": 1, "epoch": 0, "loss": 1.25},
        {"step": 2, "epoch": 0, "loss": 1.0, "val_acc": 0.75},
        {"step": 3, "epoch": 1, "loss": 0.5},
    ]


@pytest.mark.parametrize("on_accelerator", [False, True], ids=["cpu-tensors", "accelerator-tensors"])
def test_no_host_sync_per_step_and_one_per_flush(tmp_path: Path, on_accelerator: bool) -> None:
    """Logging reads nothing. A flush (the CSV logger's ``csv_cells``, the TensorBoard logger's
    ``drain``) reads CPU tensors directly and stacks the others (simulated: ``is_cpu`` False),
    moving them to the host once per device and dtype, never one value at a time."""
    logger = CSVLogger(root_dir=tmp_path, flush_every_n_steps=1000)
    calls = {"tolist": 0, "item": 0, "stack": 0, "cpu": 0}
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "cpu")}
    real_stack = torch.stack

    def count(name, real):
        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        return wrapper

    patches = [mock.patch.object(torch.Tensor, name, count(name, fn)) for name, fn in real.items()]
    patches.append(mock.patch.object(torch, "stack", count("stack", real_stack)))
    if on_accelerator:
        patches.append(mock.patch.object(torch.Tensor, "is_cpu", property(lambda self: False)))
    buf = MetricBuffer()
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        for step in range(50):
            values = {"loss": torch.tensor(float(step)), "acc": torch.tensor(step / 100)}
            logger.log_metrics(values, step=step)
            buf.add(values, step=step, epoch=None)
        assert calls == {"tolist": 0, "item": 0, "stack": 0, "cpu": 0}
        rows: Any = None
        for flush in (logger.flush, buf.drain):
            calls.update(dict.fromkeys(calls, 0))
            rows = flush()
            if on_accelerator:  # both float32: one stack, one transfer
                assert calls == {"tolist": 1, "item": 0, "stack": 1, "cpu": 0}
            else:
                assert calls == {"tolist": 0, "item": 100, "stack": 0, "cpu": 0}
    assert rows[49] == (49, None, {"loss": 49.0, "acc": float(torch.tensor(0.49))})  # from drain
    rows = read_metrics(logger.log_dir)
    assert len(rows) == 50 and rows[49] == {"step": 49, "loss": 49.0, "acc": 0.49}


def test_logged_tensor_changed_in_place_later_keeps_its_logged_value(tmp_path: Path) -> None:
    logger = CSVLogger(root_dir=tmp_path)
    running = torch.tensor(1.0)
    logger.log_metrics({"running": running}, step=0)
    running.add_(10.0)
    logger.finalize("success")
    assert read_metrics(logger.log_dir) == [{"step": 0, "running": 1.0}]


def test_int_metrics_stay_exact_and_bad_values_are_rejected() -> None:
    buf = MetricBuffer()
    buf.add({"samples": torch.tensor(2**40 + 1), "lr": 0.1}, step=5, epoch=None)
    assert buf.drain() == [(5, None, {"samples": float(2**40 + 1), "lr": 0.1})]
    with pytest.raises(ValueError, match=r"logged metric 'm' has shape \(3,\); loggers take scalars"):
        buf.add({"m": torch.ones(3)}, step=0, epoch=None)
    with pytest.raises(TypeError, match="logged metric 'name' is a str; log a number or a scalar tensor"):
        buf.add({"name": "x"}, step=0, epoch=None)
    with pytest.raises(ValueError, match="flush_every_n_steps=0 must be an int >= 1"):
        CSVLogger(flush_every_n_steps=0)


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    other = CSVLogger(root_dir=tmp_path, rank_zero=False)
    other.log_metrics({"loss": 1.0}, step=0)
    other.log_hyperparams({"lr": 0.1})
    other.finalize("success")
    attached = CSVLogger(root_dir=tmp_path)
    attached.attach(SimpleNamespace(is_global_zero=False, current_epoch=0))  # type: ignore[arg-type]
    attached.log_metrics({"loss": 1.0}, step=0)
    attached.finalize("success")
    assert not (tmp_path / "torchrig_logs").exists()


def test_epoch_is_read_from_the_attached_trainer(tmp_path: Path) -> None:
    logger = CSVLogger(root_dir=tmp_path)
    trainer = SimpleNamespace(is_global_zero=True, current_epoch=4)
    logger.attach(trainer)  # type: ignore[arg-type]
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=9)
    logger.finalize("success")
    assert read_metrics(logger.log_dir) == [{"step": 9, "epoch": 4, "loss": 0.5}]


def test_resumed_run_appends_to_its_metrics_file(tmp_path: Path) -> None:
    first = CSVLogger(root_dir=tmp_path, version=0)
    first.log_metrics({"loss": 2.0}, step=0)
    first.finalize("success")
    again = CSVLogger(root_dir=tmp_path, version=0)
    again.log_metrics({"loss": 1.0}, step=1)
    again.log_metrics({"acc": 0.5}, step=1)
    again.finalize("success")
    assert read_metrics(again.log_dir) == [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0, "acc": 0.5}]
    # A third run's values at the step the file ends with join its last line, read from the file.
    third = CSVLogger(root_dir=tmp_path, version=0, flush_every_n_steps=1)
    third.log_metrics({"acc": 0.75, "epoch": 3}, step=1)
    third.log_metrics({"loss": 0.5, "epoch": 3}, step=2)
    third.log_metrics({"lr": 0.125, "epoch": 4}, step=2)  # a new column: the file is rewritten
    third.finalize("success")
    assert third.metrics_file.read_text().splitlines() == [
        "step,epoch,loss,acc,lr",
        "0,,2.0,,",
        "1,3,1.0,0.75,",  # the later value wins; the line had no epoch, so it takes the new one
        "2,3,0.5,,0.125",  # the epoch of the step's first value
    ]


def test_buffer_drains_the_rows_of_one_step_as_one(tmp_path: Path) -> None:
    """Rows logged one after the other at one step drain as one row (later values win, the first
    epoch stays), without changing an owned row or showing a row's left out name; rows of a step
    logged again after another step stay apart."""
    owned = {"loss": torch.tensor(0.5), "epoch": 0}
    buf = MetricBuffer()
    buf.add(owned, step=4, epoch=0, skip="epoch", owned=True)
    buf.add({"val_loss": torch.tensor(0.25), "loss": 0.75}, step=4, epoch=0)
    buf.add({"lr": 0.125}, step=4, epoch=1)
    buf.add({"loss": 1.0}, step=5, epoch=None)
    buf.add({"loss": 2.0}, step=4, epoch=None)
    assert buf.drain() == [
        (4, 0, {"loss": 0.75, "val_loss": 0.25, "lr": 0.125}),
        (5, None, {"loss": 1.0}),
        (4, None, {"loss": 2.0}),
    ]
    assert owned == {"loss": torch.tensor(0.5), "epoch": 0}
    buf.add({"a": 1.0}, step=0, epoch=None)
    buf.add({"b": 2.0}, step=0, epoch=7)
    assert buf.drain_columns() == ([0], [7], {"a": [1.0], "b": [2.0]})


class _Halving(Regressor):
    """The Regressor with a learning rate halved every epoch (so each epoch's rows show their own)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


@pytest.mark.parametrize("flush_every_n_steps", [None, 1], ids=["flushed-at-the-end", "flushed-every-call"])
def test_metrics_csv_has_one_row_per_step_and_a_resume_that_trains_nothing_appends_nothing(
    tmp_path: Path, flush_every_n_steps: int | None
) -> None:
    """A fit logging the loss every step, the validation loss at the end of each epoch and the
    learning rate (LearningRateMonitor) writes one line per step holding all three. Resuming
    from its last checkpoint (saved after the last batch, before that epoch's validation) with
    no step left to train runs that validation again: the file stays byte-identical. A resume
    with an epoch to train continues the same file, one line per step."""
    import torchrig

    def fit(max_epochs: int, ckpt_path: str | None = None) -> None:
        trainer = quiet_trainer(
            tmp_path,
            max_epochs=max_epochs,
            log_every_n_steps=1,
            logger=CSVLogger(root_dir=tmp_path, version=0, flush_every_n_steps=flush_every_n_steps),
            enable_checkpointing=True,
            callbacks=[
                torchrig.LearningRateMonitor(),
                torchrig.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True),
            ],
        )
        trainer.fit(_Halving(), loader(16), loader(8), ckpt_path=ckpt_path)

    fit(max_epochs=2)
    path = tmp_path / "torchrig_logs" / "version_0" / "metrics.csv"
    before = path.read_bytes()
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["epoch"] for r in rows] == [0] * 4 + [1] * 4
    assert [r["lr-SGD"] for r in rows] == [0.05] * 4 + [0.025] * 4
    assert all("train_loss" in r for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert before.decode().splitlines()[0] == "step,epoch,train_loss,lr-SGD,val_loss"

    fit(max_epochs=2, ckpt_path="last")  # nothing left to train
    assert path.read_bytes() == before

    fit(max_epochs=3, ckpt_path="last")
    after = path.read_bytes()
    assert after.startswith(before)
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 12]
    assert [r["lr-SGD"] for r in rows[8:]] == [0.0125] * 4


def test_hparams_yaml(tmp_path: Path) -> None:
    logger = CSVLogger(root_dir=tmp_path)
    logger.log_hyperparams({"lr": 0.1, "layers": [64, 64], "path": tmp_path, "opt": {"name": "sgd"}})
    saved = yaml.safe_load((logger.log_dir / "hparams.yaml").read_text())
    assert saved == {"lr": 0.1, "layers": [64, 64], "path": str(tmp_path), "opt": {"name": "sgd"}}


def test_a_fit_writes_hparams_yaml_only_for_a_module_with_hparams(tmp_path: Path) -> None:
    from trainer_helpers import Regressor, loader

    import torchrig

    with_hparams = Regressor()
    with_hparams.hparams = {"lr": 0.1, "hidden": 8}
    for module, name in ((with_hparams, "with"), (Regressor(), "without")):
        trainer = torchrig.Trainer(
            max_epochs=1,
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path / name,
        )
        trainer.fit(module, loader(16))
        run = tmp_path / name / "torchrig_logs" / "version_0"
        assert (run / "metrics.csv").is_file()
        if name == "with":
            assert yaml.safe_load((run / "hparams.yaml").read_text()) == {"lr": 0.1, "hidden": 8}
        else:
            assert not (run / "hparams.yaml").exists()


def test_read_metrics_explains_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no metrics.csv in .*; pass a run directory a CSVLogger wrote"):
        read_metrics(tmp_path)


def test_tensorboard_writes_event_files_readable_by_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(root_dir=tmp_path, flush_every_n_steps=2)
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "sgd"}})
    for step in range(3):
        logger.log_metrics({"loss": torch.tensor(1.0 / (step + 1)), "epoch": 0}, step=step)
    logger.finalize("success")
    assert (logger.log_dir / "hparams.yaml").exists()
    events = EventAccumulator(str(logger.log_dir))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [round(e.value, 4) for e in loss] == [1.0, 0.5, 0.3333]
    assert [e.value for e in events.Scalars("epoch")] == [0.0, 0.0, 0.0]


def test_tensorboard_missing_says_how_to_install(tmp_path: Path) -> None:
    with (
        mock.patch.dict("sys.modules", {"torch.utils.tensorboard": None}),
        pytest.raises(ImportError, match=r"install it with `pip install tensorboard` \(in a clone of torchrig: "),
    ):
        TensorBoardLogger(root_dir=tmp_path)


def test_tensorboard_logger_in_a_fit_without_hparams(tmp_path: Path) -> None:
    # Metrics first, no log_hyperparams before them: the event file is opened by the first flush.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(root_dir=tmp_path, flush_every_n_steps=2)
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=0)
    logger.log_metrics({"loss": torch.tensor(0.25)}, step=1)
    copy = pickle.loads(pickle.dumps(logger))  # what a started process receives: no open file
    assert copy._summary is None
    logger.finalize("success")
    events = EventAccumulator(str(logger.log_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 0.5), (1, 0.25)]


def test_logged_values_are_those_of_the_step_they_were_logged_at(tmp_path: Path) -> None:
    # A buffer updated in place and a view of a parameter are copied when logged; the loss (an
    # autograd result) is kept as is. The CSV, flushed only at the end, shows each step's value.
    import torchrig

    class Counting(torchrig.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))
            self.register_buffer("seen", torch.zeros(()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen += 1
            loss = (self.w * batch[0]).sum()
            self.log("seen", self.seen)
            self.log("w0", self.w[0])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(3, 2)), batch_size=1)
    logger = CSVLogger(root_dir=tmp_path, flush_every_n_steps=100)
    trainer = torchrig.Trainer(
        accelerator="cpu",
        max_steps=3,
        log_every_n_steps=1,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Counting(), data)
    rows = read_metrics(logger.log_dir)
    assert [r["seen"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r["w0"] for r in rows] == [1.0, 0.5, 0.0]  # before each step's update
    assert [r["loss"] for r in rows] == [2.0, 1.0, 0.0]


def test_csv_logger_flushes_by_time_by_default(tmp_path: Path) -> None:
    clock = [100.0]
    with mock.patch("torchrig.trainer.loggers.time.monotonic", lambda: clock[0]):
        logger = CSVLogger(root_dir=tmp_path)
        assert (logger.flush_every_n_steps, logger.flush_every_seconds) == (None, 10.0)
        for step in range(50):  # 50 steps within 10 s: all still buffered
            logger.log_metrics({"loss": torch.tensor(float(step))}, step=step)
            clock[0] += 0.1
        assert not (logger.log_dir / "metrics.csv").exists()
        clock[0] += 10.0
        logger.log_metrics({"loss": torch.tensor(50.0)}, step=50)  # 10 s since the logger began
        assert [r["step"] for r in read_metrics(logger.log_dir)] == list(range(51))
        logger.log_metrics({"loss": torch.tensor(51.0)}, step=51)  # the clock starts again
        assert len(read_metrics(logger.log_dir)) == 51


def test_csv_logger_flushes_by_count_and_at_the_row_cap(tmp_path: Path) -> None:
    by_count = CSVLogger(root_dir=tmp_path / "a", flush_every_n_steps=3, flush_every_seconds=None)
    for step in range(4):
        by_count.log_metrics({"loss": torch.tensor(1.0)}, step=step)
    assert len(read_metrics(by_count.log_dir)) == 3
    with mock.patch("torchrig.trainer.loggers.MAX_BUFFERED_ROWS", 5):
        capped = CSVLogger(root_dir=tmp_path / "b", flush_every_seconds=None)
        for step in range(5):
            capped.log_metrics({"loss": torch.tensor(1.0)}, step=step)
    assert len(read_metrics(capped.log_dir)) == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flush_every_n_steps": 0}, r"flush_every_n_steps=0 must be an int >= 1 \(or None\)"),
        ({"flush_every_n_steps": True}, r"flush_every_n_steps=True must be an int, not bool \(or None\)"),
        ({"flush_every_seconds": 0}, r"flush_every_seconds=0 must be a finite number > 0 \(or None; default 10.0\)"),
        ({"flush_every_seconds": "5"}, r"flush_every_seconds='5' must be a number, not str \(or None; default 10.0\)"),
    ],
)
def test_flush_settings_are_checked(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CSVLogger(root_dir=tmp_path, **kwargs)


def _mixed_buffer() -> MetricBuffer:
    buf = MetricBuffer()
    big = 2**40 + 1  # exact in float64, not in float32
    buf.add({"n": torch.tensor(big), "acc": torch.tensor(0.49), "lr": 1e-3}, step=0, epoch=0)
    half = torch.tensor(0.1, dtype=torch.bfloat16)
    buf.add({"half": half, "x": torch.tensor(1 / 3, dtype=torch.float64)}, step=1, epoch=0)
    buf.add({"acc": torch.tensor([0.25])}, step=2, epoch=None)  # a 1-element tensor
    return buf


def test_buffer_reads_every_dtype_exactly_and_csv_writes_float32_in_its_shortest_form(tmp_path: Path) -> None:
    buf = _mixed_buffer()
    rows = buf.drain()
    # Exact values: a float32 0.49 is the float it holds, not the decimal that was typed.
    half = torch.tensor(0.1, dtype=torch.bfloat16)
    assert rows[0] == (0, 0, {"n": float(2**40 + 1), "acc": float(torch.tensor(0.49)), "lr": 0.001})
    assert rows[1] == (1, 0, {"half": float(half), "x": 1 / 3})
    assert rows[2] == (2, None, {"acc": 0.25})
    assert len(buf) == 0 and buf.drain() == []
    # The CSV file shows each float32-held value in the shortest form that reads back the same:
    # bfloat16 holds 0.1 as 0.10009765625, whose shortest float32 form is 0.100097656.
    logger = CSVLogger(root_dir=tmp_path, rank_zero=True)
    logger._write(_mixed_buffer())
    with logger.metrics_file.open(newline="") as f:
        lines = list(csv.reader(f))
    assert lines == [
        ["step", "epoch", "n", "acc", "lr", "half", "x"],
        ["0", "0", "1099511627777.0", "0.49", "0.001", "", ""],
        ["1", "0", "", "", "", "0.100097656", "0.3333333333333333"],
        ["2", "", "", "0.25", "", "", ""],
    ]


def test_csv_cells_gives_each_column_as_format_floats_writes_it() -> None:
    """Column by column, each value as format_floats writes it (also those float32 cannot show
    briefly); missing cells empty, the skipped name ("epoch", the row's own) not a column."""
    values = [0.49, 1 / 3, float("nan"), float("inf"), -0.0, 1e-45, 3.0, 1e30]
    buf = MetricBuffer()
    for step, value in enumerate(values):
        row = {"loss": torch.tensor(value), "epoch": 7}
        if step == 2:
            row["acc"] = torch.tensor(0.5)
        buf.add(row, step=step, epoch=7, skip="epoch", owned=True)
    buf.add({"loss": 2.5}, step=99, epoch=None)  # a number: the column leaves the fast path
    steps, epochs, columns = csv_cells(buf)
    floats = [float(torch.tensor(v)) for v in values]
    assert steps == [str(s) for s in range(len(values))] + ["99"]
    assert epochs == ["7"] * len(values) + [""]
    assert list(columns) == ["loss", "acc"]  # "epoch" is the row's epoch, not a metric
    assert columns["loss"] == format_floats([*floats, 2.5])
    assert columns["loss"][:3] == ["0.49", "0.33333334", "nan"]
    assert columns["acc"] == ["", "", "0.5"] + [""] * (len(values) - 2)
    fast = MetricBuffer()
    for step, value in enumerate(values):
        fast.add({"loss": torch.tensor(value)}, step=step, epoch=None, owned=True)
    assert csv_cells(fast)[2]["loss"] == format_floats(floats)
    assert len(fast) == 0 and csv_cells(fast) == ([], [], {})


def test_format_floats_handles_what_float32_cannot_hold() -> None:
    values = [float("nan"), float("inf"), -0.0, 1e300, 3.0, 1e-45]
    assert format_floats(values) == ["nan", "inf", "-0.0", "1e+300", "3.0", "1e-45"]
