"""ProgressBar: a rich live bar in a terminal, plain lines elsewhere, and no per-step host sync."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from rich.console import Console

from torchrig.trainer.callbacks import EventSchedule
from torchrig.trainer.metrics import to_floats
from torchrig.trainer.progress import ProgressBar

pytestmark = pytest.mark.timeout(20)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def fake_trainer(**kw: Any) -> SimpleNamespace:
    base = dict(
        is_global_zero=True,
        current_epoch=0,
        max_epochs=2,
        num_training_batches=4,
        num_val_batches=[3],
        num_test_batches=[3],
        num_sanity_val_steps=2,
        progress_bar_metrics={"acc": torch.tensor(0.5)},
        logged_metrics={},
    )
    base.update(kw)
    return SimpleNamespace(**base)


def run_fit(bar: ProgressBar, trainer: SimpleNamespace, epochs: int = 2) -> None:
    bar.on_fit_start(trainer, None)  # type: ignore[arg-type]
    bar.on_eval_start(trainer, None, "sanity_check")  # type: ignore[arg-type]
    bar.on_eval_end(trainer, None, "sanity_check")  # type: ignore[arg-type]
    for epoch in range(epochs):
        trainer.current_epoch = epoch
        bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
        for i in range(4):
            bar.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0 / (i + 1))}, None, i)  # type: ignore[arg-type]
        evaluate(bar, trainer, "validate", {"val_loss": torch.tensor(0.125 * (epoch + 1)), "epoch": epoch})
        bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    bar.on_fit_end(trainer, None)  # type: ignore[arg-type]


def evaluate(bar: ProgressBar, trainer: SimpleNamespace, stage: str, logged: dict[str, Any]) -> None:
    bar.on_eval_start(trainer, None, stage)  # type: ignore[arg-type]
    for i in range(3):
        bar.on_eval_batch_end(trainer, None, stage, None, None, i)  # type: ignore[arg-type]
    trainer.logged_metrics = logged
    bar.on_eval_end(trainer, None, stage)  # type: ignore[arg-type]


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    bar = ProgressBar(console=Console(file=out, width=200))
    assert not bar.is_live
    trainer = fake_trainer()
    run_fit(bar, trainer)
    evaluate(bar, trainer, "test", {"test_acc": torch.tensor(0.875)})
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines  # no sanity line; one line per validation, epoch and test
    assert re.fullmatch(r"Validation: 3 batches in \d+\.\d\ds, val_loss=0\.125", lines[0])
    assert re.fullmatch(r"Epoch 0/1: 4 steps in \d+\.\d\ds \(\d+\.\d it/s\), loss=0\.25 acc=0\.5", lines[1])
    assert lines[2].startswith("Validation: 3 batches") and lines[2].endswith("val_loss=0.25")
    assert lines[3].startswith("Epoch 1/1: 4 steps")
    assert re.fullmatch(r"Test: 3 batches in \d+\.\d\ds, test_acc=0\.875", lines[4])
    assert "\x1b[" not in out.getvalue()


def test_live_bar_in_a_terminal_shows_progress_speed_and_metrics() -> None:
    out = io.StringIO()
    bar = ProgressBar(refresh_interval=0.0, console=Console(file=out, force_terminal=True, width=160))
    assert bar.is_live
    trainer = fake_trainer()
    run_fit(bar, trainer, epochs=1)
    evaluate(bar, trainer, "test", {"test_acc": torch.tensor(0.875)})
    text = ANSI.sub("", out.getvalue())
    assert "Epoch 0/1" in text and "4/4" in text
    assert re.search(r"\d+\.\d it/s", text)
    assert "loss=0.25 acc=0.5" in text
    assert "Validation" in text and "3/3" in text
    assert "Sanity check" in text
    assert re.search(r"Test: 3 batches in \d+\.\d\ds, test_acc=0\.875", text)
    assert "\x1b[" in out.getvalue()  # it really drew with terminal control codes


def test_an_epoch_without_a_length_shows_steps_and_their_rate_without_a_total() -> None:
    """docs/data.md: for a stream without a length "the progress bar shows steps and their rate,
    without a total" (no ``n/inf``, no time left)."""
    out = io.StringIO()
    bar = ProgressBar(refresh_interval=0.0, console=Console(file=out, force_terminal=True, width=160))
    run_fit(bar, fake_trainer(num_training_batches=float("inf")), epochs=1)
    text = ANSI.sub("", out.getvalue())
    assert re.search(r"Epoch 0/1 .*\b4 \d+\.\d it/s", text), text
    assert "inf" not in text and "4/" not in text, text


def test_steps_between_refreshes_convert_nothing() -> None:
    out = io.StringIO()
    bar = ProgressBar(refresh_interval=3600, console=Console(file=out, force_terminal=True, width=200))
    trainer = fake_trainer(num_training_batches=200)
    calls = {"n": 0}
    real = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> Any:
        calls["n"] += 1
        return real(self)

    bar.on_fit_start(trainer, None)  # type: ignore[arg-type]
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    with mock.patch.object(torch.Tensor, "tolist", counting), mock.patch.object(torch.Tensor, "item") as item:
        for i in range(200):
            bar.on_train_batch_end(trainer, None, torch.tensor(float(i)), None, i)  # type: ignore[arg-type]
        # 200 steps: the first one draws (nothing was drawn yet), then none is due: one transfer
        assert calls["n"] == 1 and item.call_count == 0
        bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
        # The epoch's finished line is kept with its loss still a tensor until the next redraw.
        assert calls["n"] == 1 and item.call_count == 0
        assert "200 steps in" not in out.getvalue()
        bar.on_fit_end(trainer, None)  # type: ignore[arg-type]
        assert calls["n"] == 3  # the final redraw, and the kept line (one transfer each)
    assert re.search(r"Epoch 0/1: 200 steps in \d+\.\d\ds \(\d+\.\d it/s\), loss=199", out.getvalue()), out.getvalue()


def test_the_position_comes_from_batch_idx_so_sparse_calls_and_resumes_show_it() -> None:
    # The Trainer calls on_train_batch_end at most every refresh_interval (plain lines: only for
    # the loop's last batch); a fit resumed mid-epoch starts with no epoch start.
    assert ProgressBar(refresh_interval=0.25, console=Console(file=io.StringIO(), force_terminal=True)).event_schedule(
        "on_train_batch_end"
    ) == EventSchedule(seconds=0.25)
    plain = ProgressBar(console=Console(file=io.StringIO()))
    assert plain.event_schedule("on_train_batch_end") == EventSchedule(seconds=float("inf"))
    assert plain.event_schedule("on_train_epoch_end") == EventSchedule()
    out = io.StringIO()
    bar = ProgressBar(console=Console(file=out, width=200))
    trainer = fake_trainer(progress_bar_metrics={})
    bar.on_fit_start(trainer, None)  # type: ignore[arg-type]
    bar.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    bar.on_train_batch_end(trainer, None, torch.tensor(0.5), None, 3)  # type: ignore[arg-type]
    bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    resumed = fake_trainer(progress_bar_metrics={}, fit_state=SimpleNamespace(batch_idx=2), current_epoch=1)
    bar.on_fit_start(resumed, None)  # type: ignore[arg-type]
    bar.on_train_batch_end(resumed, None, torch.tensor(0.25), None, 3)  # type: ignore[arg-type]
    bar.on_train_epoch_end(resumed, None)  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"Epoch 0/1: 4 steps in \d+\.\d\ds \(\d+\.\d it/s\), loss=0\.5", lines[0]), lines
    assert re.fullmatch(r"Epoch 1/1: 2 steps in .*, loss=0\.25", lines[1]), lines  # batches 2 and 3 ran here

    live = io.StringIO()  # in a terminal, the resumed epoch's bar shows at once, where it is
    bar = ProgressBar(refresh_interval=0.0, console=Console(file=live, force_terminal=True, width=160))
    bar.on_fit_start(resumed, None)  # type: ignore[arg-type]
    text = ANSI.sub("", live.getvalue())
    assert "Epoch 1/1" in text and "2/4" in text
    bar.on_train_batch_end(resumed, None, torch.tensor(0.25), None, 3)  # type: ignore[arg-type]
    bar.on_fit_end(resumed, None)  # type: ignore[arg-type]
    assert "4/4" in ANSI.sub("", live.getvalue())


def test_only_rank_zero_draws() -> None:
    out = io.StringIO()
    bar = ProgressBar(console=Console(file=out, width=200))
    trainer = fake_trainer(is_global_zero=False)
    run_fit(bar, trainer)
    evaluate(bar, trainer, "test", {"test_acc": torch.tensor(0.5)})
    assert out.getvalue() == ""


def test_to_floats_keeps_order_and_skips_non_scalars() -> None:
    values = {"b": torch.tensor(2.0), "skip": torch.ones(2), "a": 1, "c": torch.tensor(3, dtype=torch.int64)}
    assert to_floats(values) == {"b": 2.0, "a": 1.0, "c": 3.0}
    assert list(to_floats(values)) == ["b", "a", "c"]


def test_bad_refresh_interval() -> None:
    with pytest.raises(ValueError, match=r"refresh_interval=-1 must be a finite number >= 0 \(seconds; default 0.5\)"):
        ProgressBar(refresh_interval=-1)


@pytest.mark.timeout(60)
def test_with_the_trainer_plain_lines_and_the_default_csv_logger(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from torchrig.trainer.loggers import read_metrics
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

    class Line(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]), prog_bar=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x = torch.linspace(-1, 1, 16).unsqueeze(1)
    data = TensorDataset(x, 3 * x - 1)
    out = io.StringIO()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        callbacks=[ProgressBar(console=Console(file=out, width=200))],
    )
    trainer.fit(Line(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines  # validation then epoch, twice; the sanity check prints nothing
    assert re.fullmatch(r"Validation: 2 batches in \d+\.\d\ds, val_loss=[\d.]+", lines[0])
    assert re.fullmatch(r"Epoch 0/1: 4 steps in .* it/s\), loss=[\d.]+ train_loss=[\d.]+ val_loss=[\d.]+", lines[1])
    assert lines[3].startswith("Epoch 1/1: 4 steps")

    rows = read_metrics(tmp_path / "torchrig_logs" / "version_0")
    assert [(r["step"], r["epoch"]) for r in rows if "train_loss" in r] == [(s, (s - 1) // 4) for s in range(1, 9)]
    assert [(r["step"], r["epoch"]) for r in rows if "val_loss" in r] == [(4, 0), (8, 1)]
    shown = float(lines[2].rsplit("val_loss=", 1)[1])  # the bar shows what the logger wrote
    assert shown == pytest.approx([r["val_loss"] for r in rows if "val_loss" in r][1], rel=1e-3)
    # The Trainer calls the bar's batch end sparsely, always for an epoch's last batch: the loss
    # on each epoch's line is that batch's.
    for line, step in ((lines[1], 4), (lines[3], 8)):
        loss = float(re.search(r"loss=([\d.]+)", line).group(1))  # type: ignore[union-attr]
        assert loss == pytest.approx(next(r["train_loss"] for r in rows if r["step"] == step), rel=1e-3)


def test_short_epochs_in_a_terminal_show_their_steps_metrics_and_a_line_each() -> None:
    """Epochs shorter than refresh_interval: no redraw is due within one, yet each leaves its
    finished line (steps, rate, loss, metrics) above the bar, and no frame is stuck at 0/N."""
    out = io.StringIO()
    bar = ProgressBar(refresh_interval=3600, console=Console(file=out, force_terminal=True, width=200))
    trainer = fake_trainer()
    run_fit(bar, trainer, epochs=2)
    text = ANSI.sub("", out.getvalue())
    finished = [line for line in text.splitlines() if re.match(r"\s*Epoch \d/1: 4 steps in", line)]
    assert len(finished) == 2, text
    assert re.search(r"Epoch 0/1: 4 steps in \d+\.\d\ds \(\d+\.\d it/s\), loss=0\.25 acc=0\.5", finished[0])
    assert "Epoch 1/1: 4 steps in" in finished[1]
    assert "4/4" in text and "0/4" not in text


def test_the_terminal_bars_last_frame_shows_the_last_epoch_not_one_past_it(tmp_path: Path) -> None:
    from trainer_helpers import Regressor, loader

    from torchrig.trainer.trainer import Trainer

    out = io.StringIO()
    bar = ProgressBar(refresh_interval=0.0, console=Console(file=out, force_terminal=True, width=200))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[bar],
    )
    trainer.fit(Regressor(), loader(8, batch_size=4))
    text = ANSI.sub("", out.getvalue())
    assert trainer.current_epoch == 3 and "Epoch 2/2" in text
    assert "Epoch 3/2" not in text
