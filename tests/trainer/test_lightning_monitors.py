"""ModelCheckpoint and EarlyStopping under Lightning 2.6's Trainer and under torchrig's, the same
module and seed: which checkpoints are kept and which is best, when the fit stops; then a fit
resumed from a checkpoint saved after a validation in the middle of an epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hook_recording import linear_module, quiet_lightning, sum_data
from trainer_helpers import quiet_trainer

import torchrig

pl = pytest.importorskip("lightning.pytorch")
pl_callbacks = pytest.importorskip("lightning.pytorch.callbacks")


def module_class(base: type) -> type:
    class Module(linear_module(base)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.loss(batch))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.6)  # large: the losses go up and down

    return Module


def fit(
    framework: str, tmp_path: Path, checkpoint: dict[str, Any] | None, stopping: dict[str, Any] | None, **settings: Any
) -> dict[str, Any]:
    torch.manual_seed(0)
    folder = tmp_path / framework
    common = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": folder}
    common |= {"num_sanity_val_steps": 0, "enable_checkpointing": checkpoint is not None, **settings}
    lib: Any = pl_callbacks if framework == "lightning" else torchrig
    callbacks: list[Any] = []
    if checkpoint is not None:
        callbacks.append(lib.ModelCheckpoint(dirpath=folder / "ckpt", **checkpoint))
    if stopping is not None:
        callbacks.append(lib.EarlyStopping(**stopping))
    if framework == "lightning":
        quiet_lightning()
        trainer: Any = pl.Trainer(accelerator="cpu", callbacks=callbacks, **common)
        module = module_class(pl.LightningModule)()
    else:
        trainer = torchrig.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, **common)
        module = module_class(torchrig.TrainingModule)()
    trainer.fit(module, sum_data(), sum_data() if settings.get("limit_val_batches") != 0 else None)
    out: dict[str, Any] = {"global_step": trainer.global_step, "epoch": trainer.current_epoch}
    if checkpoint is not None:
        ckpt = callbacks[0]
        out["kept"] = sorted(Path(p).name.removesuffix(".ckpt") for p in ckpt.best_k_models)
        out["best"] = Path(ckpt.best_model_path).name.removesuffix(".ckpt")
        out["best_score"] = round(float(ckpt.best_model_score), 5)
    if stopping is not None:
        out["stopped_epoch"] = callbacks[-1].stopped_epoch
    return out


CASES: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]] = {
    "checkpoint-val-top2": ({"monitor": "val_loss", "save_top_k": 2}, None, {"max_epochs": 5}),
    "checkpoint-train-max": ({"monitor": "train_loss", "mode": "max"}, None, {"max_epochs": 4}),
    "checkpoint-mid-epoch-validation": (
        {"monitor": "val_loss", "save_top_k": 3},
        None,
        {"max_epochs": 2, "val_check_interval": 2},
    ),
    "checkpoint-every-2nd-epoch-validation": (
        {"monitor": "val_loss", "save_top_k": -1},
        None,
        {"max_epochs": 4, "check_val_every_n_epoch": 2},
    ),
    "checkpoint-steps-before-validation": (
        {"monitor": "val_loss", "every_n_train_steps": 3, "save_top_k": 2},
        None,
        {"max_epochs": 3},
    ),
    "stop-val": (None, {"monitor": "val_loss", "patience": 1, "min_delta": 0.5}, {"max_epochs": 10}),
    "stop-train-with-validation": (None, {"monitor": "train_loss", "patience": 0, "mode": "max"}, {"max_epochs": 10}),
    "stop-train-without-validation": (
        None,
        {"monitor": "train_loss", "patience": 0, "mode": "max"},
        {"max_epochs": 10, "limit_val_batches": 0},
    ),
    "stop-mid-epoch-validation": (
        None,
        {"monitor": "val_loss", "patience": 0, "mode": "max"},
        {"max_epochs": 10, "val_check_interval": 2},
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:ModelCheckpoint\\(monitor='val_loss'\\) found no such logged metric")
@pytest.mark.parametrize("case", CASES)
def test_checkpoints_and_stops_as_under_lightning(tmp_path: Path, case: str) -> None:
    checkpoint, stopping, settings = CASES[case]
    theirs = fit("lightning", tmp_path, checkpoint, stopping, **settings)
    ours = fit("torchrig", tmp_path, checkpoint, stopping, **settings)
    assert ours == theirs
    if stopping is not None:
        assert ours["epoch"] < settings["max_epochs"]  # the fit did stop early


@pytest.mark.timeout(60)
def test_a_fit_resumed_from_a_checkpoint_saved_after_a_mid_epoch_validation_is_exact(tmp_path: Path) -> None:
    def run(folder: Path, ckpt_path: Path | None = None) -> tuple[torchrig.ModelCheckpoint, Any]:
        torch.manual_seed(0)
        checkpoint = torchrig.ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=-1)
        settings = {"max_epochs": 2, "val_check_interval": 2, "enable_model_summary": False}
        trainer = quiet_trainer(folder, callbacks=[checkpoint], enable_checkpointing=True, **settings)
        module = module_class(torchrig.TrainingModule)()
        trainer.fit(module, sum_data(), sum_data(), ckpt_path=ckpt_path)
        return checkpoint, (module.layer.weight.detach().clone(), trainer.global_step, trainer.callback_metrics)

    whole, (weight, steps, metrics) = run(tmp_path / "whole")
    # Saved after the validations at steps 2, 4 (epoch 0's end), 6 and 8.
    assert sorted(Path(p).name for p in whole.best_k_models) == [
        "epoch=0-step=2",
        "epoch=0-step=4",
        "epoch=1-step=6",
        "epoch=1-step=8",
    ]
    mid = tmp_path / "whole" / "epoch=1-step=6"  # after the validation in the middle of epoch 1
    resumed, (resumed_weight, resumed_steps, resumed_metrics) = run(tmp_path / "resumed", ckpt_path=mid)
    # The validation at step 6 had run when it was saved: not again, only the one at step 8.
    assert [Path(p).name for p in resumed.best_k_models] == ["epoch=1-step=8"]
    assert resumed_steps == steps == 8
    assert torch.equal(resumed_weight, weight)
    assert float(resumed_metrics["val_loss"]) == float(metrics["val_loss"])
