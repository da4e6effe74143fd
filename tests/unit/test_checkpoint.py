"""rig.save / rig.load: contents, round trips, retention, the ``last`` link, and mismatch reports."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.checkpoint import CheckpointError


class Tied(nn.Module):
    def __init__(self, vocab: int = 10, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.drop = nn.Dropout(0.5)
        self.register_buffer("transposed", torch.arange(12.0).reshape(3, 4).t())  # not contiguous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.mid(self.emb(x))))


def setup(rig: torchrig.Rig, seed: int = 0) -> dict[str, object]:
    torch.manual_seed(seed)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    loader = DataLoader(TensorDataset(torch.arange(20) % 10), batch_size=4, shuffle=True)
    model, optimizer, loader = rig.prepare(model, optimizer, loader)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader}


def train(state: dict[str, object], steps: int) -> None:
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    it = iter(state["data"])  # type: ignore[call-overload]
    for _ in range(steps):
        (x,) = next(it)
        model(x).square().mean().backward()  # type: ignore[operator]
        optimizer.step()  # type: ignore[attr-defined]
        optimizer.zero_grad()  # type: ignore[attr-defined]
        scheduler.step()  # type: ignore[attr-defined]


@pytest.fixture
def rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


@pytest.mark.timeout(10)
def test_round_trip_restores_everything_and_returns_values(rig: torchrig.Rig, tmp_path: Path) -> None:
    state = setup(rig)
    train(state, 2)
    path = rig.save(tmp_path / "step-2", {**state, "step": 2, "epoch": 0, "best": 0.5})
    py, npy, th = random.random(), np.random.rand(), torch.rand(3)  # what comes after the save

    fresh = setup(rig, seed=1)
    target = {**fresh, "step": -1}
    left = rig.load(path, target)
    assert left == {"step": 2, "epoch": 0, "best": 0.5}
    assert target["step"] == 2  # plain values are filled in place too
    for a, b in zip(state["model"].parameters(), fresh["model"].parameters(), strict=True):  # type: ignore[attr-defined]
        assert torch.equal(a, b)
    m = fresh["model"].module  # type: ignore[attr-defined]
    assert m.out.weight is m.emb.weight, "tied weights must stay tied after loading"
    assert torch.equal(m.transposed, torch.arange(12.0).reshape(3, 4).t())
    assert fresh["optimizer"].state_dict()["state"][0]["step"] == 2  # type: ignore[attr-defined]
    assert fresh["scheduler"].state_dict()["last_epoch"] == 2  # type: ignore[attr-defined]
    assert fresh["data"].state_dict()["batches_seen"] == 2  # type: ignore[attr-defined]
    assert (random.random(), np.random.rand()) == (py, npy) and torch.equal(torch.rand(3), th)


@pytest.mark.timeout(10)
def test_meta_json_lists_versions_counters_and_checksums(rig: torchrig.Rig, tmp_path: Path) -> None:
    state = setup(rig)
    path = rig.save(tmp_path / "ck", {**state, "step": 7, "epoch": 1})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["torch"] == torch.__version__ and meta["torchrig"] == torchrig.__version__
    assert (meta["world_size"], meta["step"], meta["epoch"], meta["sharded"]) == (1, 7, 1, False)
    assert set(meta["files"]) == {"model.safetensors", "state.pt"}
    for name, entry in meta["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert meta["parameters"] == 10 * 4 + 4 * 4 + 4  # the tied matrix counts once
    assert meta["buffers"] == 12  # counted apart from the parameters
    assert meta["entries"]["optimizer"]["type"] == "torch.optim.adamw.AdamW"
    saved = safetensors.torch.load_file(str(path / "model.safetensors"))
    assert "out.weight" not in saved and "emb.weight" in saved  # stored once, re-tied on load


@pytest.mark.timeout(10)
def test_keep_last_and_the_last_link(rig: torchrig.Rig, tmp_path: Path) -> None:
    model = rig.prepare(nn.Linear(2, 2))
    for step in range(1, 5):
        rig.save(tmp_path / f"step-{step}", {"model": model, "step": step}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-3", "step-4"]
    assert (tmp_path / "last").is_symlink() and os.readlink(tmp_path / "last") == "step-4"
    assert rig.load(tmp_path / "last")["step"] == 4
    with pytest.raises(ValueError, match="keep_last=0 must be an int >= 1; pass None to keep every checkpoint"):
        rig.save(tmp_path / "x", {"model": model}, keep_last=0)
    with pytest.raises(ValueError, match="'last' is the link torchrig points at the newest"):
        rig.save(tmp_path / "last", {"model": model})


@pytest.mark.timeout(10)
def test_overwriting_a_checkpoint_and_an_interrupted_replace(rig: torchrig.Rig, tmp_path: Path) -> None:
    model = rig.prepare(nn.Linear(2, 2))
    rig.save(tmp_path / "ck", {"model": model, "step": 1}, link=None)
    rig.save(tmp_path / "ck", {"model": model, "step": 2}, link=None)
    assert rig.load(tmp_path / "ck")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    # A kill between the two renames of a replace leaves the previous checkpoint under .ck.old-*.
    os.rename(tmp_path / "ck", tmp_path / ".ck.old-1234abcd")
    with pytest.warns(UserWarning, match="a save was interrupted while replacing it"):
        assert rig.load(tmp_path / "ck")["step"] == 2


@pytest.mark.timeout(10)
def test_mismatches_say_exactly_what_differs(rig: torchrig.Rig, tmp_path: Path) -> None:
    model = rig.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    path = rig.save(tmp_path / "ck", {"model": model})

    wider = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(CheckpointError) as err:
        rig.load(path, {"model": wider})
    text = str(err.value)
    assert "shape mismatch for 0.weight: checkpoint (8, 4), module (16, 4)" in text
    assert "shape mismatch for 2.weight: checkpoint (2, 8), module (2, 16)" in text

    deeper = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(2\): 3.weight \(2, 2\), 3.bias \(2,\)"):
        rig.load(path, {"model": deeper})
    shallow = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(
        CheckpointError, match=r"in the checkpoint but not in the module \(2\): 2.bias \(2,\), 2.weight \(2, 8\)"
    ):
        rig.load(path, {"model": shallow})
    with pytest.raises(CheckpointError, match="no name in common: this checkpoint was saved from a different model"):
        rig.load(path, {"model": nn.GRU(2, 2)})
    with pytest.raises(CheckpointError, match=r"has no entries \['optimizer'\]; it has \['model'\]"):
        rig.load(path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1)})

    rig.load(path, {"model": shallow}, strict=False)  # loads what matches
    assert torch.equal(shallow[0].weight, model.module[0].weight)


@pytest.mark.timeout(10)
def test_optimizer_of_another_model_is_a_clear_error(rig: torchrig.Rig, tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    path = rig.save(tmp_path / "ck", {"optimizer": optimizer})
    other = torch.optim.Adam([nn.Parameter(torch.ones(2))])
    with pytest.raises(
        CheckpointError,
        match=r"entry .optimizer. does not match the Adam given:\n  parameter group 0: 2 parameters in the checkpoint",
    ):
        rig.load(path, {"optimizer": other})


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=10),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o, [torch.optim.lr_scheduler.LinearLR(o), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)], [2]
        ),
    ],
    ids=["lambda", "onecycle", "cosine-restarts", "plateau", "sequential"],
)
def test_scheduler_state_survives_weights_only_loading(rig: torchrig.Rig, tmp_path: Path, make: object) -> None:
    def build() -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.9)
        return opt, make(opt)  # type: ignore[operator]

    opt, sched = build()
    for _ in range(4):
        opt.step()
        sched.step(1.0) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()  # type: ignore[attr-defined]
    path = rig.save(tmp_path / "ck", {"optimizer": opt, "scheduler": sched})
    opt2, sched2 = build()
    rig.load(path, {"optimizer": opt2, "scheduler": sched2})
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.state_dict().keys() == sched.state_dict().keys()  # type: ignore[attr-defined]


@pytest.mark.timeout(10)
def test_grad_scaler_state_round_trips(rig: torchrig.Rig, tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    path = rig.save(tmp_path / "ck", {"scaler": scaler, "precision": rig.precision})
    other = torch.amp.GradScaler("cpu")
    rig.load(path, {"scaler": other, "precision": rig.precision})
    assert other.get_scale() == 1024.0 and other.get_growth_interval() == 7


@pytest.mark.timeout(10)
def test_load_without_state_returns_tensors_on_the_rig_device(rig: torchrig.Rig, tmp_path: Path) -> None:
    model = rig.prepare(nn.Linear(3, 2))
    path = rig.save(tmp_path / "ck", {"model": model, "step": 3})
    out = rig.load(path)
    assert out["step"] == 3
    assert set(out["model"]) == {"weight", "bias"} and out["model"]["weight"].device == rig.device
    assert torch.equal(out["model"]["weight"], model.weight)


@pytest.mark.timeout(10)
def test_bad_keys_and_state(rig: torchrig.Rig, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"state key '../evil' cannot name a checkpoint entry"):
        rig.save(tmp_path / "ck", {"../evil": 1})
    with pytest.raises(TypeError, match="save\\(\\) takes state as a dict"):
        rig.save(tmp_path / "ck", [1, 2])  # type: ignore[arg-type]
    assert not (tmp_path / "ck").exists()


@pytest.mark.timeout(10)
def test_map_location_and_reading_leaves_rng_alone(rig: torchrig.Rig, tmp_path: Path) -> None:
    from torchrig.checkpoint import load

    model = rig.prepare(nn.Linear(3, 2))
    path = rig.save(tmp_path / "ck", {"model": model, "head": nn.Linear(2, 1)})
    expected = torch.rand(2)
    torch.manual_seed(0)
    out = load(rig, path, map_location="meta")
    assert out["model"]["weight"].device.type == "meta" and out["head"]["bias"].device.type == "meta"
    assert not torch.equal(torch.rand(2), expected)  # not restored: nothing was resumed


@pytest.mark.timeout(10)
def test_consolidate_prefixes_several_modules(rig: torchrig.Rig, tmp_path: Path) -> None:
    from torchrig.checkpoint import consolidate

    path = rig.save(tmp_path / "ck", {"generator": nn.Linear(2, 2), "critic": nn.Linear(2, 1), "step": 1})
    tensors = safetensors.torch.load_file(str(consolidate(path, tmp_path / "all.safetensors")))
    assert set(tensors) == {"generator.weight", "generator.bias", "critic.weight", "critic.bias"}
    with pytest.raises(ValueError, match="holds no module weights to consolidate"):
        consolidate(rig.save(tmp_path / "values", {"step": 1}), tmp_path / "x.safetensors")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("soon", "TORCHRIG_SAVE_ARRIVAL_TIMEOUT='soon' must be a number of seconds, such as 60"),
        ("-1", "TORCHRIG_SAVE_ARRIVAL_TIMEOUT=-1.0 must be a finite number >= 0"),
        ("nan", "TORCHRIG_SAVE_ARRIVAL_TIMEOUT=nan must be a finite number >= 0"),
    ],
)
def test_the_arrival_timeout_variable_is_checked(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    from torchrig.checkpoint import rounds

    monkeypatch.setenv("TORCHRIG_SAVE_ARRIVAL_TIMEOUT", value)
    with pytest.raises(ValueError, match=re.escape(message)):
        rounds.arrival_warning_seconds()
    monkeypatch.setenv("TORCHRIG_SAVE_ARRIVAL_TIMEOUT", "2.5")
    assert rounds.arrival_warning_seconds() == 2.5
    monkeypatch.delenv("TORCHRIG_SAVE_ARRIVAL_TIMEOUT")
    assert rounds.arrival_warning_seconds() == 60.0
