"""The Lightning hooks a migrated module relies on: misnamed hooks warn, prepare_data and
configure_model run where Lightning runs them, the batch-transfer hooks move the batch, the
module's own dataloaders are used."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig


class Typo(Regressor):
    def on_train_epoch_ends(self) -> None: ...


class TypoCallback(torchrig.Callback):
    def on_validation_batch_ended(self, trainer: Any, module: Any, *args: Any) -> None: ...

    def on_something_else(self) -> None: ...


@pytest.mark.timeout(30)
def test_a_misnamed_hook_is_a_warning_naming_the_nearest_hook(tmp_path: Any) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[TypoCallback()])
    with pytest.warns(UserWarning) as caught:
        trainer.fit(Typo(), loader(8))
    lines = [str(w.message) for w in caught]
    assert (
        "Typo.on_train_epoch_ends is not a hook torchrig calls, so it never runs; did you mean on_train_epoch_end?"
        in lines
    )
    assert (
        "TypoCallback.on_validation_batch_ended is not a hook torchrig calls, so it never runs; "
        "did you mean on_validation_batch_end?"
    ) in lines
    assert (
        "TypoCallback.on_something_else is not a hook torchrig calls, so it never runs; "
        "no hook has a similar name (docs/migrating.md lists them)"
    ) in lines


class Prepared(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.head: torch.nn.Module | None = None

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup({stage})")

    def configure_model(self) -> None:
        self.calls.append("configure_model")
        if self.head is None:
            self.head = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return self.head(self.net(x))


@pytest.mark.timeout(30)
def test_prepare_data_then_setup_then_configure_model_inside_init_module(tmp_path: Any) -> None:
    module = Prepared()
    trainer = quiet_trainer(tmp_path, max_epochs=1, precision="bf16-true")
    trainer.fit(module, loader(8))
    assert module.calls == ["prepare_data", "setup(fit)", "configure_model"]
    assert module.head is not None and module.head.weight.dtype == torch.bfloat16  # built under init_module
    # Built before configure_optimizers, so the optimizer steps it too.
    assert any(p is module.head.weight for p in trainer.optimizers[0].param_groups[0]["params"])
    trainer.validate(module, loader(4))
    assert module.calls[3:] == ["prepare_data", "setup(validate)", "configure_model"]


class Transfers(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.devices: list[torch.device] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return {"x": x, "y": y, "where": dataloader_idx}

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.devices.append(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch["x"] * 0.0, batch["y"]  # the step sees what the hooks made of the batch


@pytest.mark.timeout(30)
def test_the_batch_transfer_hooks_make_the_batch_the_steps_see(tmp_path: Any) -> None:
    module = Transfers()
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, loader(8, batch_size=4), loader(4, batch_size=4))
    assert module.devices == [torch.device("cpu")] * 3  # two training batches, one validation batch
    assert trainer.run.train_loader.move_batches is False  # the loader leaves the moving to the hooks
    # The steps saw x * 0: the prediction is the same for every sample.
    out = trainer.predict(module, loader(4, batch_size=4))
    assert torch.allclose(out[0], out[0][0].expand_as(out[0]))


class OwnData(Regressor):
    def train_dataloader(self) -> Any:
        return loader(8, batch_size=4)

    def val_dataloader(self) -> Any:
        return loader(4, batch_size=4)


@pytest.mark.timeout(30)
def test_the_modules_own_dataloaders_are_used_without_loaders_or_datamodule(tmp_path: Any) -> None:
    module = OwnData()
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module)
    assert trainer.global_step == 2 and "val_loss" in trainer.callback_metrics
    assert "val_loss" in trainer.validate(module)[0]
    with pytest.raises(
        ValueError,
        match=r"test\(\) needs data: pass dataloaders=, a datamodule= with "
        r"test_dataloader\(\), or define test_dataloader\(\) on OwnData",
    ):
        trainer.test(module)
    with pytest.raises(
        ValueError, match=r"fit\(\) needs training data: .* or define train_dataloader\(\) on Regressor"
    ):
        trainer.fit(Regressor())


class EpochStarts(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[int, int]] = []

    def on_train_epoch_start(self) -> None:
        self.starts.append((self.trainer.current_epoch, self.trainer.fit_state.batch_idx))


@pytest.mark.timeout(60)
def test_on_train_epoch_start_runs_for_the_epoch_a_fit_resumes_into(tmp_path: Any) -> None:
    every3 = torchrig.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = quiet_trainer(tmp_path, max_epochs=1, callbacks=[every3], enable_checkpointing=True)
    module = EpochStarts()
    first.fit(module, loader(16, batch_size=4))
    saved = tmp_path / "ckpt" / "epoch=0-step=3"  # after 3 of epoch 0's 4 batches
    resumed = EpochStarts()
    quiet_trainer(tmp_path, max_epochs=2).fit(resumed, loader(16, batch_size=4), ckpt_path=saved)
    assert module.starts == [(0, 0)]
    assert resumed.starts == [(0, 3), (1, 0)]  # as Lightning: also for the epoch resumed mid-way
