"""Lightning's own demo module and datamodule (``lightning.pytorch.demos.boring_classes``), their
class bodies as Lightning wrote them with the base class swapped to torchrig's, fit, validate,
test and predict under torchrig with the same losses and weights as under Lightning."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from hook_recording import quiet_lightning

import torchrig

pl = pytest.importorskip("lightning.pytorch")
boring = pytest.importorskip("lightning.pytorch.demos.boring_classes")


def torchrig_class(cls: type, lightning_base: str, base: type) -> type:
    """``cls`` defined again from its source, deriving from ``base`` instead of ``lightning_base``."""
    source = inspect.getsource(cls).replace(f"({lightning_base})", "(Base)", 1)
    namespace: dict[str, Any] = {**vars(boring), "Base": base}
    exec(compile(source, inspect.getsourcefile(cls) or "<boring>", "exec"), namespace)
    return namespace[cls.__name__]  # type: ignore[no-any-return]


class Losses:
    """A callback body for both frameworks: each training batch's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


class LightningLosses(Losses, pl.Callback):
    pass


class TorchrigLosses(Losses, torchrig.Callback):
    pass


def _run(module: Any, datamodule: Any, trainer: Any, losses: Losses) -> dict[str, Any]:
    trainer.fit(module, datamodule=datamodule)
    trainer.validate(module, datamodule=datamodule)
    trainer.test(module, datamodule=datamodule)
    predictions = trainer.predict(module, datamodule=datamodule)
    return {"losses": losses.losses, "weights": module.state_dict(), "predictions": torch.cat(predictions)}


@pytest.mark.timeout(120)
def test_boring_model_and_datamodule_train_as_under_lightning(tmp_path: Any) -> None:
    quiet_lightning()
    model_cls = torchrig_class(boring.BoringModel, "LightningModule", torchrig.TrainingModule)
    data_cls = torchrig_class(boring.BoringDataModule, "LightningDataModule", torchrig.DataModule)
    settings = {"max_epochs": 2, "limit_train_batches": 16, "limit_val_batches": 4, "num_sanity_val_steps": 0}
    settings |= {"limit_test_batches": 4, "limit_predict_batches": 4, "enable_progress_bar": False}
    settings |= {"enable_checkpointing": False, "logger": False, "enable_model_summary": False}

    torch.manual_seed(0)
    theirs_module, theirs_data, theirs_losses = boring.BoringModel(), boring.BoringDataModule(), LightningLosses()
    torch.manual_seed(0)
    ours_module, ours_data, ours_losses = model_cls(), data_cls(), TorchrigLosses()
    assert isinstance(ours_module, torchrig.TrainingModule) and isinstance(ours_data, torchrig.DataModule)
    assert torch.equal(theirs_data.random_full.data, ours_data.random_full.data)

    theirs_trainer = pl.Trainer(accelerator="cpu", callbacks=[theirs_losses], default_root_dir=tmp_path, **settings)
    ours_trainer = torchrig.Trainer(
        accelerator="cpu", devices=1, callbacks=[ours_losses], default_root_dir=tmp_path, **settings
    )
    theirs = _run(theirs_module, theirs_data, theirs_trainer, theirs_losses)
    ours = _run(ours_module, ours_data, ours_trainer, ours_losses)
    assert len(ours["losses"]) == 32
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
    for key, value in theirs["weights"].items():
        assert torch.allclose(ours["weights"][key], value, atol=1e-6), key
    assert torch.allclose(ours["predictions"], theirs["predictions"], atol=1e-6)
    # StepLR(step_size=1) multiplied the lr by 0.1 after each of the two epochs.
    assert ours_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**2)
