"""Lightning's Trainer arguments: min_epochs/min_steps, inference_mode, benchmark, sync_batchnorm,
enable_autolog_hparams, and the Lightning-only ones refused with what to use instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer, run_script

import torchrig


class StopEveryBatch(torchrig.Callback):
    """Asks the fit to stop after every batch (as an impatient EarlyStopping would)."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.should_stop = True


def test_min_steps_holds_a_stop_until_reached(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=10, min_steps=5, callbacks=[StopEveryBatch()])
    trainer.fit(Regressor(), loader(8, batch_size=4))  # 2 steps an epoch
    assert trainer.global_step == 5  # stops at the first batch end where 5 steps are done, mid-epoch
    out = capsys.readouterr().out
    assert out.count("the fit goes on to min_epochs=0 and min_steps=5") == 1  # said once


def test_min_epochs_holds_a_stop_until_the_epochs_are_complete(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=10, min_epochs=3, callbacks=[StopEveryBatch()])
    trainer.fit(Regressor(), loader(8, batch_size=4))
    assert (trainer.current_epoch, trainer.global_step) == (3, 6)


def test_without_minimums_a_stop_ends_the_fit_at_once(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=10, callbacks=[StopEveryBatch()])
    trainer.fit(Regressor(), loader(8, batch_size=4))
    assert trainer.global_step == 1


def test_min_epochs_holds_early_stopping(tmp_path: Path) -> None:
    # val_loss never improves on the first epoch with lr=0 (patience 0): EarlyStopping asks at once
    early = torchrig.EarlyStopping(monitor="val_loss", patience=0, min_delta=1.0)
    trainer = quiet_trainer(tmp_path, max_epochs=8, min_epochs=4, callbacks=[early])
    trainer.fit(Regressor(lr=0.0), loader(8, batch_size=4), loader(8, batch_size=4))
    assert trainer.current_epoch == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_epochs": 5, "max_epochs": 3}, "min_epochs=5 is more than max_epochs=3; the fit could not reach it"),
        ({"min_steps": 9, "max_steps": 4}, "min_steps=9 is more than max_steps=4; the fit could not reach it"),
        ({"min_epochs": -1}, "min_epochs"),
        ({"inference_mode": "yes"}, "inference_mode='yes' must be True or False"),
        ({"benchmark": 1}, "benchmark=1 must be True, False or None"),
        ({"sync_batchnorm": None}, "sync_batchnorm=None must be True or False"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        torchrig.Trainer(accelerator="cpu", **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "instead"),
    [
        ("plugins", ["MixedPrecision"], "give precision= (a name or a torchrig.Precision), strategy="),
        ("barebones", True, "enable_progress_bar=False, enable_checkpointing=False, logger=False"),
        ("model_registry", "my-model", "save with a ModelCheckpoint or trainer.save_checkpoint(path)"),
    ],
)
def test_lightning_only_arguments_are_refused_with_what_to_use(name: str, value: Any, instead: str) -> None:
    with pytest.raises(ValueError, match="is a Lightning argument torchrig does not take") as info:
        torchrig.Trainer(accelerator="cpu", **{name: value})
    assert f"Trainer({name}={value!r})" in str(info.value)
    assert instead in str(info.value)


def test_lightning_only_arguments_at_their_defaults_pass_and_typos_are_named() -> None:
    torchrig.Trainer(accelerator="cpu", plugins=None, barebones=False, model_registry=None, logger=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_epoch'; did you mean 'max_epochs'"):
        torchrig.Trainer(accelerator="cpu", max_epoch=3)


class RecordsGradMode(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.modes: list[tuple[bool, bool]] = []

    def _note(self) -> None:
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._note()
        super().validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._note()
        return super().predict_step(batch, batch_idx)


@pytest.mark.parametrize(("inference", "expected"), [(True, (True, False)), (False, (False, False))])
def test_evaluation_runs_under_inference_mode_or_no_grad(tmp_path: Path, inference: bool, expected: Any) -> None:
    module = RecordsGradMode()
    trainer = quiet_trainer(tmp_path, max_epochs=1, inference_mode=inference)
    trainer.fit(module, loader(8, batch_size=4), loader(4, batch_size=4))
    trainer.validate(module, loader(4, batch_size=4))
    trainer.predict(module, loader(4, batch_size=4))
    assert module.modes == [expected] * 3
    # training after an evaluation under inference mode still works (the logged values are not reused)
    trainer.max_epochs = 2
    trainer.fit(module, loader(8, batch_size=4), loader(4, batch_size=4))
    assert trainer.global_step == 4


@pytest.mark.parametrize(("kwargs", "expected"), [({"benchmark": True}, True), ({"deterministic": True}, False)])
def test_benchmark_sets_cudnn_autotuning(tmp_path: Path, kwargs: dict[str, Any], expected: bool) -> None:
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not expected
    try:
        trainer = quiet_trainer(tmp_path, max_epochs=1, **kwargs)
        trainer.fit(Regressor(), loader(8, batch_size=4))
        assert torch.backends.cudnn.benchmark is expected
    finally:
        torch.backends.cudnn.benchmark = before
        torch.use_deterministic_algorithms(False)


class WithHparams(Regressor):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


@pytest.mark.parametrize("autolog", [True, False])
def test_enable_autolog_hparams(tmp_path: Path, autolog: bool) -> None:
    trainer = quiet_trainer(
        tmp_path, max_epochs=1, logger=torchrig.CSVLogger(root_dir=tmp_path), enable_autolog_hparams=autolog
    )
    trainer.fit(WithHparams(lr=0.01), loader(8, batch_size=4))
    files = list(tmp_path.rglob("hparams.yaml"))
    assert bool(files) is autolog
    if autolog:
        assert "lr: 0.01" in files[0].read_text()


# -- sync_batchnorm on 2 gloo processes against one process with the global batch -----------------
BN_SCRIPT = r"""
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import torchrig


class BNNet(torchrig.TrainingModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


devices, batch, sync, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
g = torch.Generator().manual_seed(1)
x = torch.randn(32, 4, generator=g) * torch.tensor([1.0, 5.0, 0.2, 3.0]) + 2.0
data = TensorDataset(x, x.sum(dim=1, keepdim=True))
module = BNNet()
trainer = torchrig.Trainer(
    accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2, seed=5,
    sync_batchnorm=sync, enable_progress_bar=False, logger=False, enable_checkpointing=False,
    enable_model_summary=False, default_root_dir=out + ".d",
)
trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=True))
kinds = sorted({type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__})
if trainer.is_global_zero:
    torch.save(module.state_dict(), out)
    with open(out + ".json", "w") as f:
        json.dump({"kinds": kinds, "steps": trainer.global_step}, f)
"""


def _bn_run(tmp_path: Path, devices: int, batch: int, sync: bool) -> tuple[dict[str, torch.Tensor], Any]:
    out = tmp_path / f"bn-{devices}-{int(sync)}.pt"
    run_script(tmp_path, BN_SCRIPT, str(devices), str(batch), str(int(sync)), str(out))
    return torch.load(out), json.loads(Path(str(out) + ".json").read_text())


@pytest.mark.timeout(240)
@pytest.mark.distributed
def test_sync_batchnorm_on_two_processes_matches_one_process_with_the_global_batch(tmp_path: Path) -> None:
    one, info_one = _bn_run(tmp_path, 1, 8, sync=True)  # one process: nothing to convert
    synced, info_sync = _bn_run(tmp_path, 2, 4, sync=True)
    plain, _ = _bn_run(tmp_path, 2, 4, sync=False)
    assert info_one["kinds"] == ["BatchNorm1d"]
    assert info_sync["kinds"] == ["SyncBatchNorm"]
    assert info_one["steps"] == info_sync["steps"] == 8
    for key, ref in one.items():
        torch.testing.assert_close(synced[key], ref, rtol=1e-5, atol=1e-5, msg=f"{key} differs")
    # without it the per-process statistics train other weights (so the comparison above can fail)
    assert not torch.allclose(plain["net.1.running_var"], one["net.1.running_var"], atol=1e-3)


def test_sync_batchnorm_refuses_tensor_parallel() -> None:
    from torchrig.strategies import convert_sync_batchnorm

    class TP:
        tensor_parallel = 2

    with pytest.raises(ValueError, match=r"sync_batchnorm=True with tensor_parallel=2: .* \(LayerNorm, GroupNorm"):
        convert_sync_batchnorm(torch.nn.BatchNorm1d(3), TP())


# -- use_distributed_sampler on 2 gloo processes --------------------------------------------------
SAMPLER_SCRIPT = r"""
import json, sys
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset
import torchrig


class Seen(torchrig.TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen += x[:, 0].int().tolist()
        return self.layer(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


use, out = sys.argv[1] == "1", sys.argv[2]
trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, use_distributed_sampler=use,
    enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
)
rank = int(__import__("os").environ.get("RANK", 0))
data = TensorDataset(torch.arange(16.0).unsqueeze(1))
mine = Subset(data, list(range(rank, 16, 2)))  # the user shards: rank r takes r, r+2, ...
module = Seen()
trainer.fit(module, DataLoader(mine, batch_size=2))
seen = trainer.rig.all_gather(torch.tensor(module.seen + [-1] * (8 - len(module.seen))))
if trainer.is_global_zero:
    with open(out, "w") as f:
        json.dump([[v for v in row if v >= 0] for row in seen.tolist()], f)
"""


@pytest.mark.timeout(240)
@pytest.mark.distributed
def test_use_distributed_sampler_false_keeps_the_users_own_shards(tmp_path: Path) -> None:
    seen = {}
    for use in (True, False):
        out = tmp_path / f"seen-{int(use)}.json"
        run_script(tmp_path, SAMPLER_SCRIPT, str(int(use)), str(out))
        seen[use] = json.loads(out.read_text())
    assert seen[False] == [list(range(0, 16, 2)), list(range(1, 16, 2))]  # each rank its whole shard, in order
    # the default splits each rank's shard again: half of the data is never seen
    assert sorted(seen[True][0] + seen[True][1]) != list(range(16))
    assert len(seen[True][0]) == len(seen[True][1]) == 4


def test_use_distributed_sampler_is_checked() -> None:
    with pytest.raises(ValueError, match="use_distributed_sampler='no' must be True or False"):
        torchrig.Trainer(accelerator="cpu", use_distributed_sampler="no")
    rig = torchrig.Rig(accelerator="cpu")
    with pytest.raises(TypeError, match="use_distributed_sampler=1 must be True or False"):
        rig.prepare(torch.utils.data.DataLoader(range(4)), use_distributed_sampler=1)


# -- reload_dataloaders_every_n_epochs --------------------------------------------------------------
class Curriculum(torchrig.DataModule):
    """Each train_dataloader() call serves a harder slice: the first calls' samples, then later ones."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 4, generator=g)
        self.data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))

    def train_dataloader(self) -> Any:
        self.calls.append(len(self.calls))
        start = 16 * (len(self.calls) - 1) % 48
        part = torch.utils.data.Subset(self.data, range(start, start + 16))
        return torch.utils.data.DataLoader(part, batch_size=4, shuffle=True)


def _curriculum_fit(root: Path, max_steps: int = -1, ckpt: Any = None) -> tuple[torchrig.Trainer, Curriculum]:
    torch.manual_seed(0)
    module, data = Regressor(dropout=0.2), Curriculum()
    trainer = quiet_trainer(
        root,
        max_epochs=5,
        max_steps=max_steps,
        reload_dataloaders_every_n_epochs=2,
        enable_checkpointing=True,
        callbacks=[torchrig.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_last=True)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    return trainer, data


def test_reload_dataloaders_asks_again_every_n_epochs_and_resumes_exactly(tmp_path: Path) -> None:
    whole, data = _curriculum_fit(tmp_path / "a")
    assert data.calls == [0, 1, 2]  # epochs 0, 2 and 4
    assert whole.global_step == 5 * 4
    _curriculum_fit(tmp_path / "b", max_steps=14)  # stops in epoch 3, two batches in (its loader: epoch 2's)
    resumed, again = _curriculum_fit(tmp_path / "b", ckpt="last")
    assert again.calls == [0, 1, 2]  # at the start, for the resumed epoch (the second call's data), at epoch 4
    assert resumed.global_step == whole.global_step
    for a, b in zip(params(whole.module), params(resumed.module), strict=True):
        assert torch.equal(a, b)


def test_reload_dataloaders_every_n_epochs_is_checked() -> None:
    with pytest.raises(ValueError, match="reload_dataloaders_every_n_epochs"):
        torchrig.Trainer(accelerator="cpu", reload_dataloaders_every_n_epochs=-1)
