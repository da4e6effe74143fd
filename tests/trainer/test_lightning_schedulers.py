"""LR scheduler configurations and ``LearningRateMonitor`` under Lightning 2.6's Trainer and
under torchrig's, the same module and seed: the learning rate at every optimizer step, the
weights, and the names the monitor logs."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hook_recording import linear_module, quiet_lightning, sum_data

import torchrig

pl = pytest.importorskip("lightning.pytorch")
pl_loggers = pytest.importorskip("lightning.pytorch.loggers")
pl_callbacks = pytest.importorskip("lightning.pytorch.callbacks")

Configure = Callable[[torch.nn.Module], Any]


def sgd(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1)


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def every_step(m: torch.nn.Module) -> Any:
    opt = sgd(m)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "step"}}


def every_second_step(m: torch.nn.Module) -> Any:
    opt = sgd(m)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "step", "frequency": 2}}


def every_second_epoch(m: torch.nn.Module) -> Any:
    opt = sgd(m)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "epoch", "frequency": 2}}


def plateau(monitor: str, mode: str) -> Configure:
    def configure(m: torch.nn.Module) -> Any:
        opt = sgd(m)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": monitor, "strict": True}}

    return configure


def lists(m: torch.nn.Module) -> Any:
    opt = sgd(m)
    return [opt], [halving(opt)]


def named_groups(m: torch.nn.Module) -> Any:
    opt = torch.optim.SGD([{"params": [m.layer.weight]}, {"params": [m.layer.bias], "lr": 0.01}], lr=0.1, momentum=0.9)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "name": "my_lr"}}


def adam(m: torch.nn.Module) -> Any:
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    return {"optimizer": opt, "lr_scheduler": halving(opt)}


def module_class(base: type, configure: Configure, lrs: list[float]) -> type:
    class Module(linear_module(base)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("train_loss", loss, on_step=False, on_epoch=True)  # falls: mode="max" sees no improvement
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.loss(batch))

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            lrs.append(round(optimizer.param_groups[0]["lr"], 8))

        def configure_optimizers(self) -> Any:
            return configure(self)

    return Module


def fit(framework: str, configure: Configure, tmp_path: Path, lr_monitor: bool = False, **settings: Any) -> Any:
    torch.manual_seed(0)
    lrs: list[float] = []
    common = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    common |= {"num_sanity_val_steps": 0, "log_every_n_steps": 1, "default_root_dir": tmp_path / framework}
    common |= settings
    if framework == "lightning":
        quiet_lightning()
        module = module_class(pl.LightningModule, configure, lrs)()
        logger: Any = pl_loggers.CSVLogger(tmp_path / framework) if lr_monitor else False
        monitor = [pl_callbacks.LearningRateMonitor(log_momentum=True)] if lr_monitor else []
        trainer: Any = pl.Trainer(accelerator="cpu", logger=logger, callbacks=monitor, **common)
    else:
        module = module_class(torchrig.TrainingModule, configure, lrs)()
        logger = torchrig.CSVLogger(root_dir=tmp_path / framework) if lr_monitor else False
        monitor = [torchrig.LearningRateMonitor(log_momentum=True)] if lr_monitor else []
        trainer = torchrig.Trainer(accelerator="cpu", devices=1, logger=logger, callbacks=monitor, **common)
    trainer.fit(module, sum_data(), sum_data())
    return lrs, module.layer.weight.detach().clone(), trainer


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "configure",
    [
        every_step,
        every_second_step,
        every_second_epoch,
        plateau("val_loss", "max"),
        plateau("train_loss", "max"),
        lists,
        adam,
    ],
    ids=["step", "step-frequency-2", "epoch-frequency-2", "plateau-val", "plateau-train", "lists", "plain"],
)
def test_schedulers_step_as_under_lightning(tmp_path: Path, configure: Configure) -> None:
    theirs, their_weight, _ = fit("lightning", configure, tmp_path, max_epochs=4)
    ours, our_weight, _ = fit("torchrig", configure, tmp_path, max_epochs=4)
    assert len(ours) == 16 and len(set(ours)) > 1  # the lr did change
    assert ours == theirs
    assert torch.allclose(our_weight, their_weight, atol=1e-6)


@pytest.mark.timeout(60)
def test_step_frequency_counts_optimizer_steps_over_the_whole_fit(tmp_path: Path) -> None:
    # frequency=3 with 4 batches an epoch: torchrig steps the scheduler at global steps 3, 6, 9
    # ("how many steps should pass", as Lightning documents it); Lightning's Trainer counts the
    # batches of the current epoch, so it steps at the 3rd batch of each epoch only (docs/migrating.md).
    def every_third_step(m: torch.nn.Module) -> Any:
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "step", "frequency": 3}}

    ours, _, _ = fit("torchrig", every_third_step, tmp_path, max_epochs=3)
    theirs, _, _ = fit("lightning", every_third_step, tmp_path, max_epochs=3)
    assert ours == [0.1] * 3 + [0.05] * 3 + [0.025] * 3 + [0.0125] * 3
    assert theirs == [0.1] * 3 + [0.05] * 4 + [0.025] * 4 + [0.0125]


def header(root: Path) -> set[str]:
    (path,) = root.rglob("metrics.csv")
    with path.open() as f:
        return set(next(csv.reader(f))) - {"step", "epoch", "train_loss", "val_loss"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("configure", [named_groups, adam], ids=["named-two-groups", "plain"])
def test_learning_rate_monitor_logs_lightnings_names(tmp_path: Path, configure: Configure) -> None:
    fit("lightning", configure, tmp_path, lr_monitor=True, max_epochs=1)
    fit("torchrig", configure, tmp_path, lr_monitor=True, max_epochs=1)
    ours = header(tmp_path / "torchrig")
    assert ours == header(tmp_path / "lightning")
    expected = {"my_lr/pg1", "my_lr/pg1-momentum", "my_lr/pg2", "my_lr/pg2-momentum"}
    assert ours == (expected if configure is named_groups else {"lr-Adam", "lr-Adam-momentum"})


@pytest.mark.timeout(30)
def test_an_unknown_scheduler_key_is_refused_and_strict_false_skips(tmp_path: Path) -> None:
    def typo(m: torch.nn.Module) -> Any:
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "intervall": "step"}}

    with pytest.raises(ValueError, match=r"lr_scheduler dict has keys torchrig does not know: \['intervall'\]"):
        fit("torchrig", typo, tmp_path, max_epochs=1)

    def not_strict(m: torch.nn.Module) -> Any:
        opt = sgd(m)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "missing", "strict": False}}

    with pytest.warns(RuntimeWarning, match="ReduceLROnPlateau monitors 'missing', which was not logged; its step"):
        lrs, _, _ = fit("torchrig", not_strict, tmp_path, max_epochs=2)
    assert lrs == [0.1] * 8
