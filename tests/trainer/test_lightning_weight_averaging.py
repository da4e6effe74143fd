"""``StochasticWeightAveraging`` and ``WeightAveraging``: Lightning's behaviour (compared with
Lightning's own callbacks on the same model and data), the average in checkpoints, an exact
resume, BatchNorm statistics computed for the average, and the errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trainer_helpers import checkpointed_fit, fit_under_lightning_and_torchrig, loader, quiet_trainer

import torchrig


def tiny_model(base: type, batchnorm: bool = False, scheduler: bool = False) -> type:
    """A small regression model for Lightning's or torchrig's base class."""

    class Model(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            norm: nn.Module = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
            self.net = nn.Sequential(nn.Linear(4, 8), norm, nn.Tanh(), nn.Linear(8, 1))
            self.losses: list[float] = []
            self.val_losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.val_losses.append(float(nn.functional.mse_loss(self(x), y)))

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if not scheduler:
                return optimizer
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    return Model


def against_lightning(tmp_path: Path, make: Any, validate: bool = False, **model: Any) -> dict[str, Any]:
    """One fit under Lightning and one under torchrig of the same model, data and callback
    (``make(callbacks_module)`` builds it): each one's module and learning rates."""
    runs = fit_under_lightning_and_torchrig(
        tmp_path,
        lambda base: tiny_model(base, **model),
        make,
        lambda: loader(32, batch_size=8),
        (lambda: loader(16, batch_size=8, seed=1)) if validate else None,
    )
    return {
        name: (module, [g["lr"] for g in trainer.optimizers[0].param_groups])
        for name, (module, trainer, _) in runs.items()
    }


def assert_same(runs: dict[str, Any]) -> None:
    (theirs, theirs_lrs), (ours, ours_lrs) = runs["lightning"], runs["torchrig"]
    assert len(ours.losses) == 16
    assert ours.losses == pytest.approx(theirs.losses, rel=1e-6)
    assert ours.val_losses == pytest.approx(theirs.val_losses, rel=1e-6)
    assert ours_lrs == pytest.approx(theirs_lrs, rel=1e-12)
    for key, value in theirs.state_dict().items():
        assert torch.allclose(ours.state_dict()[key], value, atol=1e-6), key


# -- StochasticWeightAveraging ----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_swa_trains_and_averages_as_lightnings(tmp_path: Path, strategy: str) -> None:
    runs = against_lightning(
        tmp_path,
        lambda cbs: cbs.StochasticWeightAveraging(
            swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2, annealing_strategy=strategy
        ),
        scheduler=True,
    )
    assert_same(runs)
    assert runs["torchrig"][1] != [0.05 * 0.5**4]  # SWALR replaced the StepLR from epoch 1 on


class EpochStarts(torchrig.Callback):
    """The module's parameters at the start of every training epoch."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.weights[trainer.current_epoch] = [p.detach().clone() for p in module.parameters()]


def test_swa_leaves_the_mean_of_epoch_starts_and_its_batchnorm_statistics_in_the_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = tiny_model(torchrig.TrainingModule, batchnorm=True)()
    starts = EpochStarts()
    swa = torchrig.StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=0.5, device=None)
    trainer = quiet_trainer(tmp_path, max_epochs=4, callbacks=[starts, swa])
    trainer.fit(module, loader(32, batch_size=8))
    # epochs 1, 2, 3 (int(0.5 * 4) = 2, counted from 1): the weights at their starts, averaged
    mean = [torch.stack(ws).mean(0) for ws in zip(*(starts.weights[e] for e in (1, 2, 3)), strict=True)]
    for averaged, p in zip(mean, module.parameters(), strict=True):
        assert torch.allclose(averaged, p, atol=1e-6)
    expected = copy.deepcopy(module)
    torch.optim.swa_utils.update_bn(loader(32, batch_size=8), expected)  # torch's, on the averaged weights
    bn = module.net[1]
    assert int(bn.num_batches_tracked) == 4
    assert torch.allclose(bn.running_mean, expected.net[1].running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, expected.net[1].running_var, atol=1e-6)
    assert not torch.equal(bn.running_var, torch.ones(8))


def swa_fit(root: Path, max_steps: int = -1, ckpt: str | None = None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    module = tiny_model(torchrig.TrainingModule, batchnorm=True, scheduler=True)()
    swa = torchrig.StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2)
    train = loader(32, batch_size=8, shuffle=True)
    return checkpointed_fit(root, module, [swa], train, max_epochs=4, max_steps=max_steps, ckpt=ckpt), module


@pytest.mark.timeout(120)
def test_swa_resumes_exactly(tmp_path: Path) -> None:
    """Interrupted in epoch 2 (SWALR swapped in at epoch 1, two epoch starts averaged) and
    resumed: the same weights, average, BatchNorm statistics and learning rate."""
    whole_trainer, whole = swa_fit(tmp_path / "a")
    swa_fit(tmp_path / "b", max_steps=10)
    saved = torchrig.checkpoint.read_summary(tmp_path / "b" / "ck" / "last")["entries"]
    assert saved["StochasticWeightAveraging.average"]["kind"] == "module"
    assert saved["scheduler_0"]["type"] == "torch.optim.swa_utils.SWALR"
    resumed_trainer, resumed = swa_fit(tmp_path / "b", ckpt="last")
    assert resumed_trainer.global_step == whole_trainer.global_step == 16
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed_trainer.optimizers[0].param_groups[0]["lr"] == whole_trainer.optimizers[0].param_groups[0]["lr"]
    assert whole.losses[-6:] == resumed.losses[-6:]


def test_swa_refuses_bad_arguments(tmp_path: Path) -> None:
    swa = torchrig.StochasticWeightAveraging
    with pytest.raises(ValueError, match=r"swa_lrs=-0.1: give a positive float, or a list of positive floats"):
        swa(swa_lrs=-0.1)
    with pytest.raises(ValueError, match=r"swa_lrs=\[\]"):
        swa(swa_lrs=[])
    with pytest.raises(ValueError, match=r"swa_epoch_start=1.5: a float is a fraction of max_epochs in \[0, 1\]"):
        swa(swa_lrs=0.1, swa_epoch_start=1.5)
    with pytest.raises(ValueError, match="swa_epoch_start"):
        swa(swa_lrs=0.1, swa_epoch_start=0)
    with pytest.raises(ValueError, match=r"annealing_strategy='exp': use 'cos' or 'linear'"):
        swa(swa_lrs=0.1, annealing_strategy="exp")
    trainer = quiet_trainer(tmp_path, max_epochs=-1, max_steps=4, callbacks=[swa(swa_lrs=0.1, swa_epoch_start=0.5)])
    with pytest.raises(ValueError, match=r"is a fraction of max_epochs, but max_epochs=-1: give swa_epoch_start as"):
        trainer.fit(tiny_model(torchrig.TrainingModule)(), loader(8))
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[swa(swa_lrs=[0.1, 0.2], swa_epoch_start=1)])
    with pytest.raises(ValueError, match=r"gives 2 learning rates for an optimizer with 1 parameter groups"):
        trainer.fit(tiny_model(torchrig.TrainingModule)(), loader(8))


# -- WeightAveraging ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_weight_averaging_validates_with_the_average_and_ends_with_it_as_lightnings(tmp_path: Path) -> None:
    runs = against_lightning(tmp_path, lambda cbs: cbs.WeightAveraging(), validate=True, batchnorm=True)
    assert_same(runs)
    assert len(runs["torchrig"][0].val_losses) == 8


class EveryOtherEpoch(torchrig.WeightAveraging):
    def __init__(self) -> None:
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        super().__init__(multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return (step_idx is not None and step_idx >= 3) or (epoch_idx is not None and epoch_idx % 2 == 1)


def averaging_fit(root: Path, max_steps: int = -1, ckpt: str | None = None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    module = tiny_model(torchrig.TrainingModule, batchnorm=True)()
    train, val = loader(32, batch_size=8, shuffle=True), loader(16, seed=1)
    trainer = checkpointed_fit(
        root, module, [EveryOtherEpoch()], train, val, max_epochs=3, max_steps=max_steps, ckpt=ckpt
    )
    return trainer, module


@pytest.mark.timeout(120)
def test_weight_averaging_resumes_exactly(tmp_path: Path) -> None:
    _, whole = averaging_fit(tmp_path / "a")
    averaging_fit(tmp_path / "b", max_steps=6)
    _, resumed = averaging_fit(tmp_path / "b", ckpt="last")
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert whole.val_losses[-2:] == resumed.val_losses[-2:]


def test_weight_averaging_takes_averaged_models_arguments_only() -> None:
    with pytest.raises(TypeError, match=r"got \['decay'\]; AveragedModel's keyword arguments are avg_fn, multi_avg_fn"):
        torchrig.WeightAveraging(decay=0.9)
    with pytest.raises(TypeError, match=r"use_buffers='yes'\) must be True or False"):
        torchrig.WeightAveraging(use_buffers="yes")  # type: ignore[arg-type]


def test_a_checkpoint_saved_without_the_average_cannot_be_resumed_with_it(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    trainer.fit(tiny_model(torchrig.TrainingModule)(), loader(8))
    trainer = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[torchrig.WeightAveraging()])
    with pytest.raises(torchrig.CheckpointError, match=r"has no entries \['WeightAveraging.average'\]"):
        trainer.fit(tiny_model(torchrig.TrainingModule)(), loader(8), ckpt_path="last")


@pytest.mark.parametrize("callback", [torchrig.WeightAveraging, lambda: torchrig.StochasticWeightAveraging(0.1)])
def test_sharded_strategies_are_refused_with_ema_named(tmp_path: Path, callback: Any) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, strategy="fsdp", callbacks=[callback()])
    with pytest.raises(ValueError, match=r"cannot give it; use torchrig.EMA, which averages each process's shards"):
        trainer.fit(tiny_model(torchrig.TrainingModule)(), loader(8))
