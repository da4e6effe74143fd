"""torchrig.tune.lr_find: the exponential sweep, its suggestion, early stop, plot, and that it
leaves the module, the optimizer, the RNG and the disk as they were."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_helpers import Regressor, docs_example, loader, quiet_trainer, subprocess_env

import torchrig
import torchrig.tune
from conftest import run_example
from torchrig.tune import LRFinderResult, lr_find, smooth


class LinReg(torchrig.TrainingModule):
    """Least squares on 8 features: plain SGD trains well at lr 0.03 to 0.3 and diverges at 1."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def linreg_data(seed: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.01 * torch.randn(512, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def sgd_loss(lr: float, data: DataLoader[Any], epochs: int = 2) -> float:
    torch.manual_seed(0)
    model = LinReg()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model.layer(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    x, y = data.dataset.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model.layer(x), y))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suggestion_lies_in_the_range_that_trains(tmp_path: Path, seed: int) -> None:
    data = linreg_data()
    # The problem's known range: 0.03 and 0.3 train to the noise floor, 1.0 diverges.
    assert sgd_loss(0.03, data) < 0.5 and sgd_loss(0.3, data) < 1e-3
    assert not sgd_loss(1.0, data) < 1e3
    torch.manual_seed(seed)
    result = lr_find(quiet_trainer(tmp_path), LinReg(), train_dataloaders=data)  # 1e-8 .. 1, 100 steps
    assert len(result.lrs) == len(result.losses) == 100 and not result.diverged
    for i in (0, 37, 99):
        assert result.lrs[i] == pytest.approx(1e-8 * (1 / 1e-8) ** (i / 99), rel=1e-12)
    assert result.lrs[0] == pytest.approx(1e-8) and result.lrs[-1] == pytest.approx(1.0)
    suggested = result.suggestion()
    assert 1e-2 <= suggested <= 3e-1, suggested
    assert sgd_loss(suggested, data) < 0.5


def test_sweep_stops_when_the_loss_diverges(tmp_path: Path) -> None:
    torch.manual_seed(0)
    result = lr_find(quiet_trainer(tmp_path), LinReg(), train_dataloaders=linreg_data(), max_lr=1e4)
    assert result.diverged and 50 < len(result.losses) < 100
    running = smooth(result.losses)
    assert running[-1] > 4 * min(running) and not running[-2] > 4 * min(running[:-1])  # the first step past 4x
    # Without the threshold the sweep goes on until the loss is no longer finite.
    torch.manual_seed(0)
    unbounded = lr_find(
        quiet_trainer(tmp_path), LinReg(), train_dataloaders=linreg_data(), max_lr=1e4, early_stop_threshold=None
    )
    assert unbounded.diverged and len(unbounded.losses) > len(result.losses)
    assert not math.isfinite(unbounded.losses[-1]) and all(math.isfinite(v) for v in unbounded.losses[:-1])


class Held(torchrig.TrainingModule):
    """BatchNorm (buffers that training changes) and an Adam it keeps, whose state already has moments."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        self.opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        loss = self.net(torch.randn(6, 4)).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return self.opt


def _optimizer_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]) and all(
        a["state"][i].keys() == b["state"][i].keys() for i in a["state"]
    )


def test_module_optimizer_rng_restored_bitwise_and_nothing_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Held()
    module.eval()  # the mode is put back too
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    optimizer_state = module.opt.state_dict()
    optimizer_state = {
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer_state["state"].items()},
        "param_groups": [dict(g) for g in optimizer_state["param_groups"]],
    }
    root = tmp_path / "root"
    # Defaults: a CSV logger and a ModelCheckpoint, which a fit would write under root.
    trainer = torchrig.Trainer(accelerator="cpu", default_root_dir=root, enable_progress_bar=False)
    rng = torch.get_rng_state()
    result = lr_find(trainer, module, train_dataloaders=loader(64, batch_size=8, shuffle=True), num_training=30)
    assert len(result.losses) == 30
    assert torch.equal(torch.get_rng_state(), rng)
    after = module.state_dict()
    assert after.keys() == weights.keys()
    assert all(torch.equal(after[k], weights[k]) for k in weights), "weights or buffers changed"
    assert int(after["net.1.num_batches_tracked"]) == int(weights["net.1.num_batches_tracked"])
    assert all(p.grad is None for p in module.parameters())
    assert _optimizer_equal(module.configure_optimizers().state_dict(), optimizer_state)
    assert not module.training
    assert not root.exists() or not any(root.rglob("*")), sorted(map(str, root.rglob("*")))
    assert "train_loss" not in trainer.callback_metrics  # what the sweep logged was dropped


def test_fit_after_lr_find_equals_fit_without(tmp_path: Path) -> None:
    """A fit after the sweep (shuffled data, dropout: the RNG matters) ends bitwise where a fit
    without it ends, with and without Trainer(seed=)."""
    for seed in (None, 7):
        final = []
        for sweep_first in (False, True):
            torch.manual_seed(0)
            module = Regressor(dropout=0.2)
            trainer = quiet_trainer(tmp_path / f"{seed}{sweep_first}", max_epochs=2, seed=seed)
            data = loader(32, batch_size=4, shuffle=True)
            if sweep_first:
                lr_find(trainer, module, train_dataloaders=data, num_training=12)
            trainer.fit(module, data)
            final.append([p.detach().clone() for p in module.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*final, strict=True)), f"seed={seed}"


def test_fsdp_one_process_restores_the_shards(tmp_path: Path) -> None:
    # the one-process group FSDP joins is destroyed after the test (conftest: process_group_undone)
    torch.manual_seed(0)
    module = Regressor()
    data = loader(32, batch_size=4)
    trainer = quiet_trainer(tmp_path, strategy="fsdp", max_epochs=1)
    trainer.fit(module, data)  # the parameters are DTensor shards from here on
    before = {k: v.full_tensor().clone() for k, v in module.state_dict().items()}
    result = lr_find(trainer, module, train_dataloaders=data, num_training=10)
    after = {k: v.full_tensor() for k, v in module.state_dict().items()}
    assert len(result.losses) == 10 and all(math.isfinite(v) for v in result.losses)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_lr": 1.0, "max_lr": 1.0}, "min_lr=1.0 must be smaller than max_lr=1.0"),
        ({"min_lr": 0.1, "max_lr": 0.01}, "min_lr=0.1 must be smaller than max_lr=0.01"),
        ({"min_lr": 0.0}, "min_lr=0.0 must be a finite number > 0"),
        ({"min_lr": -1e-3}, "min_lr=-0.001 must be a finite number > 0"),
        ({"max_lr": float("inf")}, "max_lr=inf must be a finite number > 0"),
        ({"max_lr": "1"}, "max_lr='1' must be a finite number > 0"),
        ({"num_training": 1}, "num_training=1 must be an int >= 2"),
        ({"num_training": 10.0}, "num_training=10.0 must be an int, not float"),
        ({"num_training": True}, "num_training=True must be an int, not bool"),
        ({"early_stop_threshold": 1.0}, "early_stop_threshold=1.0 must be a number > 1, or None"),
    ],
)
def test_arguments_are_checked(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        lr_find(quiet_trainer(tmp_path), LinReg(), train_dataloaders=linreg_data(), **kwargs)


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path)
    with pytest.raises(TypeError, match=re.escape("lr_find() takes a torchrig.TrainingModule, got Linear")):
        lr_find(trainer, torch.nn.Linear(2, 2), train_dataloaders=linreg_data())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("lr_find() needs training data: pass train_dataloaders=")):
        lr_find(trainer, LinReg())
    with pytest.raises(TypeError, match=re.escape("train_dataloaders must be a torch.utils.data.DataLoader; got list")):
        lr_find(trainer, LinReg(), train_dataloaders=[1, 2])

    class Two(LinReg):
        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    two = re.escape("lr_find() steps one optimizer; configure_optimizers() returned 2")
    with pytest.raises(ValueError, match=two):
        lr_find(trainer, Two(), train_dataloaders=linreg_data())

    class Manual(LinReg):
        automatic_optimization = False

    with pytest.raises(ValueError, match="steps the optimizer itself, but Manual sets automatic_optimization"):
        lr_find(trainer, Manual(), train_dataloaders=linreg_data())


def test_suggestion_needs_enough_steps() -> None:
    result = LRFinderResult(lrs=[1e-3, 1e-2, 1e-1], losses=[3.0, 2.0, 1.0])
    assert result.suggestion(skip_begin=0, skip_end=0) in result.lrs
    with pytest.raises(ValueError, match="recorded 3 steps; with skip_begin=10 and skip_end=1 fewer than 2"):
        result.suggestion()
    with pytest.raises(ValueError, match="skip_end=-1 must be an int >= 0"):
        result.suggestion(skip_end=-1)


def test_smoothed_is_the_lag_free_average() -> None:
    steps = [0.0] * 200 + [1.0] * 200
    result = LRFinderResult(lrs=[float(i) for i in range(1, 401)], losses=steps)
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no pull towards 0
    one_way = smooth(steps)
    # The one-way average reaches half the step well after it; the two-way average at the step.
    assert next(i for i, v in enumerate(one_way) if v >= 0.5) > 230
    assert next(i for i, v in enumerate(result.smoothed) if v >= 0.5) in (199, 200, 201)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = LRFinderResult(lrs=[10.0 ** (-i / 4) for i in range(40, 0, -1)], losses=[1.0 / (1 + i) for i in range(40)])
    path = result.plot(tmp_path / "lr.png")
    assert path == tmp_path / "lr.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    result = LRFinderResult(lrs=[1e-3, 1e-2], losses=[1.0, 0.5])
    with pytest.raises(ImportError, match=r"needs matplotlib, which is not installed; install it with pip install"):
        result.plot(tmp_path / "lr.png")
    assert not (tmp_path / "lr.png").exists()


DDP_SCRIPT = r"""
import json, sys
import torch
import torchrig, torchrig.tune
from trainer_helpers import Regressor, loader

torch.manual_seed(0)
module = Regressor()
trainer = torchrig.Trainer(accelerator="cpu", devices=2, strategy=sys.argv[2], enable_progress_bar=False,
                           default_root_dir=sys.argv[1])
before = [p.detach().clone() for p in module.parameters()]
full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP: DTensor shards
result = torchrig.tune.lr_find(trainer, module, train_dataloaders=loader(32, batch_size=4, shuffle=True),
                               num_training=20)
losses = trainer.rig.all_gather(torch.tensor(result.losses, dtype=torch.float64))
# a file per rank: two ranks printing at once can interleave their lines on the shared stdout
with open(f"result{trainer.global_rank}.json", "w") as out:
    json.dump({
        "rank": trainer.global_rank,
        "steps": len(result.losses),
        "agreed": bool(torch.equal(losses[0], losses[1])),
        "restored": all(torch.equal(a, full(b)) for a, b in zip(before, module.parameters())),
    }, out)
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_agree_on_the_losses(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    root = tmp_path / "root"
    done = subprocess.run(
        [sys.executable, str(script), str(root), strategy],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in lines] == [0, 1]
    assert all(r["steps"] == 20 and r["agreed"] and r["restored"] for r in lines), lines
    assert not root.exists() or not any(root.rglob("*"))


@pytest.mark.timeout(160)
def test_the_docs_example_runs_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = run_example(docs_example("## Learning-rate finder"), "## Learning-rate finder", tmp_path, capsys)
    printed = [line for line in out.splitlines() if line in ("100 False", "True")]
    assert printed == ["100 False", "True", "True"], out
    assert (tmp_path / "lr_find.png").read_bytes()[:4] == b"\x89PNG"


def test_training_data_from_a_datamodule(tmp_path: Path) -> None:
    calls: list[str] = []

    class Data(torchrig.DataModule):
        def setup(self, stage: str) -> None:
            calls.append(stage)

        def train_dataloader(self) -> Any:
            return linreg_data()

    result = lr_find(quiet_trainer(tmp_path), LinReg(), datamodule=Data(), num_training=5)
    assert len(result.losses) == 5 and calls == ["fit"]
