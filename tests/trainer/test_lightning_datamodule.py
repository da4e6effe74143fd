"""A LightningDataModule's hooks under Lightning 2.6's Trainer and under torchrig's: prepare_data,
setup(stage), the loaders, its batch-transfer hooks (used instead of the module's), teardown(stage),
and ``trainer.datamodule`` from the module, for fit, validate, test and predict."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hook_recording import linear_module, quiet_lightning, sum_data
from trainer_helpers import quiet_trainer

import torchrig

pl = pytest.importorskip("lightning.pytorch")


def classes(module_base: type, data_base: type, log: list[Any]) -> tuple[type, type]:
    class Data(data_base):  # type: ignore[misc,valid-type]
        def prepare_data(self) -> None:
            log.append("prepare_data")

        def setup(self, stage: str) -> None:
            log.append(f"setup({stage})")

        def teardown(self, stage: str) -> None:
            log.append(f"teardown({stage})")

        def train_dataloader(self) -> Any:
            return sum_data()

        def val_dataloader(self) -> Any:
            return sum_data(8)

        def test_dataloader(self) -> Any:
            return sum_data(8)

        def predict_dataloader(self) -> Any:
            return sum_data(8)

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return [batch[0] * 2, batch[1] * 2]  # the loss then differs from the module's batches

        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            log.append("datamodule.transfer_batch_to_device")
            return [t.to(device) for t in batch]

    class Module(linear_module(module_base)):  # type: ignore[misc]
        def setup(self, stage: str) -> None:
            log.append(("module sees", type(self.trainer.datamodule).__name__))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            log.append(round(float(loss), 5))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.loss(batch))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", self.loss(batch))

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module, Data


def run(framework: str, tmp_path: Any) -> list[Any]:
    torch.manual_seed(0)
    log: list[Any] = []
    common = {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    common |= {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    common |= {"enable_model_summary": False, "default_root_dir": tmp_path / framework}
    if framework == "lightning":
        quiet_lightning()
        module_cls, data_cls = classes(pl.LightningModule, pl.LightningDataModule, log)
        trainer: Any = pl.Trainer(accelerator="cpu", **common)
    else:
        module_cls, data_cls = classes(torchrig.TrainingModule, torchrig.DataModule, log)
        trainer = torchrig.Trainer(accelerator="cpu", devices=1, **common)
    module, data = module_cls(), data_cls()
    trainer.fit(module, datamodule=data)
    log.append(
        ("validate", [{k: round(v, 5) for k, v in r.items()} for r in trainer.validate(module, datamodule=data)])
    )
    log.append(("test", [{k: round(v, 5) for k, v in r.items()} for r in trainer.test(module, datamodule=data)]))
    log.append(("predict", round(float(torch.cat(trainer.predict(module, datamodule=data)).sum()), 4)))
    return [str(x) for x in log]  # Lightning's stages are str enums: setup(TrainerFn.FITTING) == setup(fit)


@pytest.mark.timeout(60)
def test_a_datamodules_hooks_run_as_under_lightning(tmp_path: Any) -> None:
    theirs = [
        x.replace("TrainerFn.FITTING", "fit").replace("TrainerFn.VALIDATING", "validate")
        for x in run("lightning", tmp_path)
    ]
    theirs = [x.replace("TrainerFn.TESTING", "test").replace("TrainerFn.PREDICTING", "predict") for x in theirs]
    ours = run("torchrig", tmp_path)
    assert ours == theirs
    assert "datamodule.transfer_batch_to_device" in ours and "('module sees', 'Data')" in ours


@pytest.mark.timeout(60)
def test_a_datamodules_state_is_saved_in_checkpoints_and_loaded_on_resume(tmp_path: Any) -> None:
    class Counting(torchrig.DataModule):
        def __init__(self) -> None:
            self.loaded: dict[str, Any] = {}
            self.asked = 0

        def train_dataloader(self) -> Any:
            self.asked += 1
            return sum_data()

        def state_dict(self) -> dict[str, Any]:
            return {"asked": self.asked}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = state_dict

    module_cls, _ = classes(torchrig.TrainingModule, torchrig.DataModule, [])
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_model_summary=False)
    trainer.fit(module_cls(), datamodule=Counting())
    path = trainer.save_checkpoint(tmp_path / "with-state")
    plain = quiet_trainer(tmp_path, max_epochs=1, enable_model_summary=False)
    plain.fit(module_cls(), sum_data())
    without = plain.save_checkpoint(tmp_path / "without-state")

    resumed = Counting()
    quiet_trainer(tmp_path, max_epochs=2, enable_model_summary=False).fit(
        module_cls(), datamodule=resumed, ckpt_path=path
    )
    assert resumed.loaded == {"asked": 1}
    fresh = Counting()  # a checkpoint written without a datamodule's state resumes; nothing to load
    quiet_trainer(tmp_path, max_epochs=2, enable_model_summary=False).fit(
        module_cls(), datamodule=fresh, ckpt_path=without
    )
    assert fresh.loaded == {}
