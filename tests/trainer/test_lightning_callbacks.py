"""Lightning's callbacks in torchrig: Timer, LambdaCallback, BasePredictionWriter,
GradientAccumulationScheduler, and Lightning's names for torchrig's own features."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_helpers import Regressor, loader, params, quiet_trainer, run_script

import torchrig


# -- Timer -------------------------------------------------------------------------------------------
class SlowRegressor(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import time

        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


def test_timer_stops_the_fit_after_its_budget_and_saves_last(tmp_path: Path, capsys: Any) -> None:
    timer = torchrig.Timer(duration=0.12)
    ckpt = torchrig.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    trainer = quiet_trainer(tmp_path, max_epochs=100, callbacks=[timer, ckpt], enable_checkpointing=True)
    trainer.fit(SlowRegressor(), loader(32, batch_size=4))
    assert 2 <= trainer.global_step < 10  # 0.05 s a step: stops at the step where 0.12 s are spent
    assert timer.time_elapsed("train") >= 0.12
    assert timer.time_remaining("train") is not None and timer.time_remaining("train") <= 0  # type: ignore[operator]
    assert f"torchrig: Timer: trained 0:00:00 of 0:00:00.120000; stopping at step {trainer.global_step}" in (
        capsys.readouterr().out
    )
    assert (tmp_path / "ck" / "last").exists()


def test_timer_keeps_its_elapsed_time_across_a_resume(tmp_path: Path) -> None:
    timer = torchrig.Timer(duration="00:01:00:00")
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[timer], enable_checkpointing=True)
    trainer.fit(SlowRegressor(), loader(8, batch_size=4))
    spent = timer.time_elapsed("train")
    assert spent >= 0.1
    saved = timer.state_dict()["time_elapsed"]["train"]
    resumed = torchrig.Timer(duration="00:01:00:00")
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[resumed], enable_checkpointing=True)
    trainer.fit(SlowRegressor(), loader(8, batch_size=4), ckpt_path="last")
    assert resumed.time_elapsed("train") >= saved + 0.1  # the first run's time, then the second's
    fresh = torchrig.Timer()
    fresh.load_state_dict({"time_elapsed": {"train": 12.5}})
    assert fresh.time_elapsed() == 12.5 and fresh.time_remaining() is None


def test_timer_with_its_budget_spent_trains_nothing_more_after_a_resume(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    trainer.fit(Regressor(), loader(8, batch_size=4))
    timer = torchrig.Timer(duration=3600)
    trainer = quiet_trainer(tmp_path, max_epochs=5, callbacks=[timer], enable_checkpointing=True)
    timer.load_state_dict({"time_elapsed": {"train": 4000.0}})
    before = trainer.global_step
    trainer.fit(Regressor(), loader(8, batch_size=4), ckpt_path="last")
    assert trainer.global_step - before <= 2 + 1  # stops at its first check


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration": "1 hour"}, "duration='1 hour': give seconds (> 0), a datetime.timedelta, or 'DD:HH:MM:SS'"),
        ({"duration": {"hour": 1}}, "Timer(duration={'hour': 1}):"),
        ({"interval": "batch"}, "Timer(interval='batch'); use 'step' or 'epoch'"),
    ],
)
def test_timer_refuses_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        torchrig.Timer(**kwargs)
    assert message in str(info.value)


def test_timer_accepts_lightnings_duration_forms() -> None:
    assert torchrig.Timer(duration="00:12:00:00").duration == 12 * 3600
    assert torchrig.Timer(duration={"minutes": 2}).duration == 120


# -- LambdaCallback ---------------------------------------------------------------------------------
def test_lambda_callback_calls_its_functions_with_the_events_arguments(tmp_path: Path) -> None:
    seen: list[Any] = []
    cb = torchrig.LambdaCallback(
        on_train_epoch_end=lambda trainer, module: seen.append(("epoch", trainer.current_epoch)),
        on_train_batch_end=lambda trainer, module, outputs, batch, batch_idx: seen.append(("batch", batch_idx)),
    )
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[cb])
    trainer.fit(Regressor(), loader(8, batch_size=4))
    assert seen == [("batch", 0), ("batch", 1), ("epoch", 0), ("batch", 0), ("batch", 1), ("epoch", 1)]


def test_lambda_callback_names_a_misspelt_event() -> None:
    with pytest.raises(
        TypeError, match=r"on_train_epoch_ends=\.\.\.\) is not a Callback event; did you mean .on_train_epoch_end."
    ):
        torchrig.LambdaCallback(on_train_epoch_ends=print)
    with pytest.raises(TypeError, match="give a function"):
        torchrig.LambdaCallback(on_fit_start=3)


# -- GradientAccumulationScheduler ----------------------------------------------------------------
class CountSteps(torchrig.Callback):
    def __init__(self) -> None:
        self.per_epoch: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.per_epoch.setdefault(trainer.current_epoch, []).append(trainer.global_step)


def test_accumulation_schedule_changes_the_factor_by_epoch(tmp_path: Path) -> None:
    count = CountSteps()
    sched = torchrig.GradientAccumulationScheduler({0: 4, 2: 2, 3: 1})
    trainer = quiet_trainer(tmp_path, max_epochs=4, callbacks=[sched, count])
    trainer.fit(Regressor(), loader(32, batch_size=4))  # 8 batches an epoch
    steps = {e: v[-1] - (count.per_epoch[e - 1][-1] if e else 0) for e, v in count.per_epoch.items()}
    assert steps == {0: 2, 1: 2, 2: 4, 3: 8}
    assert trainer.accumulate_grad_batches == 1  # back to the Trainer's own value


def test_accumulation_schedule_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt: Any = None, root: Path = tmp_path) -> torchrig.Trainer:
        torch.manual_seed(0)
        module = Regressor()
        trainer = quiet_trainer(
            root,
            max_epochs=3,
            max_steps=max_steps,
            enable_checkpointing=True,
            callbacks=[
                torchrig.GradientAccumulationScheduler({0: 2, 1: 4}),
                torchrig.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_last=True),
            ],
        )
        trainer.fit(module, loader(32, batch_size=4, shuffle=True), ckpt_path=ckpt)
        return trainer

    whole = fit(-1, root=tmp_path / "a")
    fit(5, root=tmp_path / "b")  # epoch 0: 4 steps; stops one step into epoch 1 (factor 4)
    resumed = fit(-1, ckpt="last", root=tmp_path / "b")
    assert resumed.global_step == whole.global_step == 4 + 2 + 2
    for a, b in zip(params(whole.module), params(resumed.module), strict=True):
        assert torch.equal(a, b)


def test_accumulation_schedule_refuses_a_second_setting(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="give a non-empty dict"):
        torchrig.GradientAccumulationScheduler({})
    with pytest.raises(ValueError, match=r"scheduling\[1\]"):
        torchrig.GradientAccumulationScheduler({1: 0})
    trainer = quiet_trainer(
        tmp_path, max_epochs=1, accumulate_grad_batches=2, callbacks=[torchrig.GradientAccumulationScheduler({0: 2})]
    )
    with pytest.raises(ValueError, match="Trainer\\(accumulate_grad_batches=2\\) and a GradientAccumulationScheduler"):
        trainer.fit(Regressor(), loader(8, batch_size=4))


# -- BasePredictionWriter -----------------------------------------------------------------------
class Writer(torchrig.BasePredictionWriter):
    def __init__(self, folder: Path, interval: str) -> None:
        super().__init__(interval)
        self.folder = folder

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx, dataloader_idx):  # type: ignore[no-untyped-def]
        torch.save(
            (prediction, batch_indices), self.folder / f"b-{trainer.global_rank}-{dataloader_idx}-{batch_idx}.pt"
        )

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):  # type: ignore[no-untyped-def]
        torch.save((predictions, batch_indices), self.folder / f"e-{trainer.global_rank}.pt")


class Echo(Regressor):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0][:, 0] * 10


def test_prediction_writer_writes_batches_with_their_dataset_indices(tmp_path: Path) -> None:
    x = torch.arange(10.0).unsqueeze(1).repeat(1, 4)
    data = DataLoader(TensorDataset(x), batch_size=4)
    trainer = quiet_trainer(tmp_path, callbacks=[Writer(tmp_path, "batch_and_epoch")])
    assert trainer.predict(Echo(), data, return_predictions=False) is None
    first, idx = torch.load(tmp_path / "b-0-0-0.pt")
    assert idx == [0, 1, 2, 3] and first.tolist() == [0.0, 10.0, 20.0, 30.0]
    assert torch.load(tmp_path / "b-0-0-2.pt")[1] == [8, 9]
    preds, indices = torch.load(tmp_path / "e-0.pt")
    assert indices == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]]
    assert torch.cat(preds[0]).tolist() == [10.0 * i for i in range(10)]
    with pytest.raises(ValueError, match="write_interval='step'"):
        torchrig.BasePredictionWriter("step")


WRITER_SCRIPT = r"""
import sys
from pathlib import Path
import torch
from torch.utils.data import DataLoader, TensorDataset
import torchrig
from trainer_helpers import Regressor
from test_lightning_callbacks import Echo, Writer

folder = Path(sys.argv[1])
trainer = torchrig.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
                           enable_checkpointing=False, callbacks=[Writer(folder, "epoch")])
x = torch.arange(11.0).unsqueeze(1).repeat(1, 4)
out = trainer.predict(Echo(), DataLoader(TensorDataset(x), batch_size=2), return_predictions=False)
assert out is None
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_prediction_writer_on_two_processes_writes_each_share_without_gathering(tmp_path: Path) -> None:
    run_script(tmp_path, WRITER_SCRIPT, str(tmp_path))
    found: dict[int, float] = {}
    for rank in (0, 1):
        preds, indices = torch.load(tmp_path / f"e-{rank}.pt")
        for p, i in zip(preds[0], indices[0], strict=True):
            found.update(zip(i, p.tolist(), strict=True))
    assert found == {i: 10.0 * i for i in range(11)}  # every sample written by one of the ranks, at its index
    assert json.dumps(sorted(found)) == json.dumps(list(range(11)))


# -- Lightning's names for torchrig features -------------------------------------------------------
def test_on_exception_checkpoint_saves_only_when_the_fit_raises(tmp_path: Path) -> None:
    class Boom(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    cb = torchrig.OnExceptionCheckpoint(dirpath=tmp_path / "ck")
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[cb], enable_checkpointing=True)
    assert trainer.checkpoint_callback is cb  # no default ModelCheckpoint besides it
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), loader(8, batch_size=4))
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith("."))
    assert saved == ["last", "on_exception"]


def test_model_summary_callback_sets_the_depth(tmp_path: Path, capsys: Any) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.ModelSummary(max_depth=2)])
    trainer.fit(Regressor(), loader(8, batch_size=4))
    out = capsys.readouterr().out
    assert "net.0" in out and "net.3" in out and "Model summary: Regressor" in out
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.RichModelSummary(max_depth=0)])
    trainer.fit(Regressor(), loader(8, batch_size=4))
    assert "Model summary" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="enable_model_summary=False, but a ModelSummary is in callbacks"):
        quiet_trainer(tmp_path, enable_model_summary=False, callbacks=[torchrig.ModelSummary()])


def test_progress_bar_and_ema_aliases() -> None:
    assert isinstance(torchrig.TQDMProgressBar(refresh_rate=10), torchrig.ProgressBar)
    assert isinstance(torchrig.RichProgressBar(), torchrig.ProgressBar)
    with pytest.raises(ValueError, match="refresh_rate=0\\) hides the bar; use Trainer\\(enable_progress_bar=False\\)"):
        torchrig.TQDMProgressBar(refresh_rate=0)
    ema = torchrig.EMAWeightAveraging(decay=0.99)
    assert isinstance(ema, torchrig.EMA) and ema.decay == 0.99
    with pytest.raises(ValueError, match="EMAWeightAveraging\\(update_every_n_steps=4\\) has no torchrig counterpart"):
        torchrig.EMAWeightAveraging(update_every_n_steps=4)
