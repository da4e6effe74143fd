"""Loop semantics: limits, validation schedule, stopping conditions, logging, data, bad arguments."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig


class Counting(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.train_batches: list[tuple[int, int]] = []
        self.val_batches: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_batches.append((self.trainer.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_batches.append(self.trainer.global_step)
        super().validation_step(batch, batch_idx)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("limit", "expected"), [(3, 3), (0.25, 2), (1.0, 10)])
def test_limit_train_batches(tmp_path: Path, limit: int | float, expected: int) -> None:
    module = Counting()
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_train_batches=limit)
    trainer.fit(module, loader(40))
    assert module.train_batches == [(e, i) for e in range(2) for i in range(expected)]
    assert trainer.global_step == 2 * expected and trainer.num_training_batches == expected


@pytest.mark.timeout(20)
def test_limit_val_and_test_batches(tmp_path: Path) -> None:
    module = Counting()
    trainer = quiet_trainer(tmp_path, max_epochs=1, limit_val_batches=2, limit_test_batches=0.5)
    trainer.fit(module, loader(8), loader(40))
    assert len(module.val_batches) == 2
    tested: list[int] = []
    module.test_step = lambda batch, i: tested.append(i)  # type: ignore[method-assign]
    trainer.test(module, loader(40))
    assert tested == [0, 1, 2, 3, 4]
    none = quiet_trainer(tmp_path, max_epochs=1, limit_val_batches=0)
    module = Counting()
    none.fit(module, loader(8), loader(40))
    assert module.val_batches == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("interval", "every", "expected"),
    [(1.0, 1, [10, 20]), (0.25, 1, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]), (4, 1, [4, 8, 14, 18]), (1.0, 2, [20])],
)
def test_val_check_interval_and_every_n_epochs(
    tmp_path: Path, interval: int | float, every: int, expected: list[int]
) -> None:
    module = Counting()
    trainer = quiet_trainer(tmp_path, max_epochs=2, val_check_interval=interval, check_val_every_n_epoch=every)
    trainer.fit(module, loader(40), loader(4))  # 10 batches an epoch, 1 validation batch
    assert module.val_batches == expected  # the global step at each validation


@pytest.mark.timeout(20)
def test_sanity_check_runs_before_training_and_is_not_logged(tmp_path: Path) -> None:
    module = Counting()
    trainer = quiet_trainer(tmp_path, max_steps=1, num_sanity_val_steps=2, val_check_interval=1)
    trainer.fit(module, loader(8), loader(40))
    assert module.val_batches[:2] == [0, 0] and len(module.val_batches) == 2 + 10


@pytest.mark.timeout(20)
def test_max_steps_and_max_time_stop_training(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_steps=5, max_epochs=100)
    trainer.fit(Regressor(), loader(12))
    assert trainer.global_step == 5 and trainer.current_epoch == 2
    timed = quiet_trainer(tmp_path, max_time=1e-9, max_epochs=100)
    timed.fit(Regressor(), loader(12))
    assert timed.global_step == 1 and timed.should_stop


class Logs(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("both", float(batch_idx), on_step=True, on_epoch=True, prog_bar=True)
        self.log("weighted", float(batch_idx), on_step=False, on_epoch=True, batch_size=batch_idx + 1)
        self.log("hidden", 1.0, logger=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log_dict({"val_a": 1.0, "val_b": torch.tensor(2.0)}, prog_bar=True)


@pytest.mark.timeout(20)
def test_logged_values_step_epoch_and_weighted_means(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, log_every_n_steps=2)
    trainer.fit(Logs(), loader(16), loader(4))  # batch_idx 0..3
    metrics = trainer.callback_metrics
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())
    assert float(metrics["both_step"]) == 3.0 and float(metrics["both_epoch"]) == 1.5
    assert float(metrics["weighted"]) == pytest.approx((0 * 1 + 1 * 2 + 2 * 3 + 3 * 4) / 10)
    assert set(trainer.progress_bar_metrics) == {"both_step", "both_epoch", "val_a", "val_b"}
    assert float(metrics["both"]) == 1.5  # once the epoch has ended, its mean (Lightning's callback_metrics)
    # The latest value of each name sent to the loggers (Lightning's logged_metrics), no "epoch".
    assert trainer.logged_metrics.keys() == {"both_step", "both_epoch", "weighted", "val_a", "val_b"}
    assert float(metrics["hidden_epoch"]) == 1.0 and "hidden_step" in metrics


@pytest.mark.timeout(20)
def test_no_host_sync_in_the_training_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[str] = []

    class Watch(torchrig.Callback):
        # From the first batch's end (the DataLoader's own per-epoch seed draw is behind us) to the epoch's end.
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx != 0:
                return
            for name in ("item", "tolist", "__float__", "__bool__", "cpu"):
                original = getattr(torch.Tensor, name)

                def spy(self: torch.Tensor, *a: Any, _n: str = name, _o: Any = original, **k: Any) -> Any:
                    syncs.append(_n)
                    return _o(self, *a, **k)

                monkeypatch.setattr(torch.Tensor, name, spy)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            monkeypatch.undo()

    trainer = quiet_trainer(tmp_path, max_epochs=1, log_every_n_steps=1, callbacks=[Watch()])
    trainer.fit(Logs(), loader(40))  # logs every step, to on-step and on-epoch values
    assert syncs == []


@pytest.mark.timeout(20)
def test_validate_and_test_return_floats_per_dataloader(tmp_path: Path) -> None:
    module = Regressor()
    trainer = quiet_trainer(tmp_path)
    one = trainer.test(module, loader(8))
    assert len(one) == 1 and isinstance(one[0]["test_loss"], float)
    two = trainer.validate(module, [loader(8), loader(8, seed=1)])
    assert [sorted(d) for d in two] == [["val_loss/dataloader_idx_0"], ["val_loss/dataloader_idx_1"]]

    class TwoLoaders(Regressor):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("idx", float(dataloader_idx))

    res = trainer.validate(TwoLoaders(), [loader(8), loader(8)])
    assert res == [{"idx/dataloader_idx_0": 0.0}, {"idx/dataloader_idx_1": 1.0}]


class Data(torchrig.DataModule):
    def __init__(self) -> None:
        self.stages: list[str] = []

    def setup(self, stage: str) -> None:
        self.stages.append(stage)

    def train_dataloader(self) -> DataLoader[Any]:
        return loader(8)

    def val_dataloader(self) -> DataLoader[Any]:
        return loader(4)

    def test_dataloader(self) -> DataLoader[Any]:
        return loader(4)

    def predict_dataloader(self) -> DataLoader[Any]:
        return loader(6, batch_size=4)


@pytest.mark.timeout(20)
def test_datamodule_feeds_every_stage(tmp_path: Path) -> None:
    data, module = Data(), Regressor()
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, datamodule=data)
    assert "val_loss" in trainer.callback_metrics
    assert list(trainer.test(module, datamodule=data)[0]) == ["test_loss"]
    assert [p.shape[0] for p in trainer.predict(module, datamodule=data)] == [4, 2]
    assert data.stages == ["fit", "test", "predict"]


@pytest.mark.timeout(20)
def test_predict_returns_every_sample_once_in_order(tmp_path: Path) -> None:
    x = torch.arange(10.0).unsqueeze(1)

    class Identity(torchrig.TrainingModule):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch[0] * 1

    out = quiet_trainer(tmp_path).predict(Identity(), DataLoader(TensorDataset(x), batch_size=3))
    assert torch.equal(torch.cat(out), x)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_epochs": -2}, ValueError, "max_epochs=-2 must be an int >= -1"),
        ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches=0 must be an int >= 1"),
        ({"gradient_clip_algorithm": "l2"}, ValueError, "gradient_clip_algorithm='l2'; use 'norm' or 'value'"),
        ({"gradient_clip_val": -1.0}, ValueError, "gradient_clip_val=-1.0 must be a finite number >= 0"),
        ({"limit_train_batches": 1.5}, ValueError, "limit_train_batches=1.5: give an int number of batches"),
        ({"val_check_interval": 0.0}, ValueError, "val_check_interval=0.0: give an int number of batches (>= 1)"),
        ({"max_time": "1h"}, ValueError, "max_time='1h': give seconds (> 0), a datetime.timedelta, or 'DD:HH:MM:SS'"),
        ({"deterministic": "yes"}, ValueError, "deterministic='yes'; use True, False, 'warn' or None"),
        ({"seed": 1.5}, TypeError, "seed=1.5 must be an int, not float"),
        ({"callbacks": [object()]}, TypeError, "callbacks must be torchrig Callback objects; got object"),
        ({"logger": "csv"}, TypeError, "logger must be a torchrig Logger, a list of them, True or False; got str"),
        ({"accelerator": "nope"}, ValueError, "nope"),
    ],
)
def test_bad_arguments_say_what_to_do(tmp_path: Path, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        quiet_trainer(tmp_path, **kwargs)


@pytest.mark.timeout(20)
def test_bad_inputs_to_fit_say_what_to_do(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    with pytest.raises(TypeError, match=r"takes a torchrig\.TrainingModule, got Linear"):
        trainer.fit(torch.nn.Linear(1, 1), loader(8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fit\(\) needs training data: pass train_dataloaders="):
        trainer.fit(Regressor())
    for data, got in (
        ([(torch.ones(1, 4), torch.ones(1, 1))], "a list holding tuple"),
        ([loader(8)] * 2, "a list holding DataLoader"),
    ):
        # It said "must be a DataLoader (or a list of them); got list": a list is not taken here
        with pytest.raises(TypeError) as refused:
            trainer.fit(Regressor(), data)
        assert str(refused.value) == (
            f"train_dataloaders must be one torch.utils.data.DataLoader; got {got} (a fit trains on one loader: join "
            "datasets with torch.utils.data.ConcatDataset)"
        )
    with pytest.raises(ValueError, match=r"val_check_interval=50 batches, but an epoch has only 2 training batches"):
        quiet_trainer(tmp_path, val_check_interval=50).fit(Regressor(), loader(8), loader(4))

    class NoLoss(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return {"value": 1}

    with pytest.raises(TypeError, match="training_step returned dict; return the loss tensor, a dict with a 'loss'"):
        trainer.fit(NoLoss(), loader(8))

    class Vector(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("vec", torch.ones(3))

    with pytest.raises(ValueError, match=r"self.log\('vec'\) got a tensor of shape \(3,\); log scalars"):
        trainer.fit(Vector(), loader(8))
    with pytest.raises(ValueError, match=r"test\(\) needs a module: pass one, or call fit\(\) first"):
        quiet_trainer(tmp_path).test(dataloaders=loader(8))
