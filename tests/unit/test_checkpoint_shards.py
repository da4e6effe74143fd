"""Large state is split over several safetensors files: round trips, damage, and format-1 checkpoints."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError, consolidate, tensors


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight  # tied, and after the cut into shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.a(self.emb(x))))


@pytest.fixture
def rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


@pytest.fixture
def small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of ~300 bytes and every tensor of 64 bytes or more out of state.pt."""
    monkeypatch.setattr(tensors, "SHARD_BYTES", 300)
    monkeypatch.setattr(tensors, "EXTRACT_BYTES", 64)


def trained(rig: torchrig.Rig, seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = TiedNet()
    model, optimizer = rig.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    for _ in range(steps):
        model(torch.arange(16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def flat(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


@pytest.mark.timeout(10)
@pytest.mark.usefixtures("small_shards")
def test_large_state_is_split_into_shards_and_round_trips_exactly(rig: torchrig.Rig, tmp_path: Path) -> None:
    model, optimizer = trained(rig, seed=0)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 2})
    meta = json.loads((path / "meta.json").read_text())
    shards = meta["entries"]["model"]["files"]
    assert len(shards) > 1 and "file" not in meta["entries"]["model"] and meta["version"] == 2
    assert all(n.startswith("model@") for n in shards)
    moved = [n for n in meta["files"] if n.startswith("state.pt@tensors")]
    assert moved, f"optimizer moments should leave state.pt: {sorted(meta['files'])}"
    for name, entry in meta["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == entry["sha256"]

    want = flat(model, optimizer)
    model2, optimizer2 = trained(rig, seed=1, steps=1)
    assert rig.load(path, {"model": model2, "optimizer": optimizer2})["step"] == 2
    got = flat(model2, optimizer2)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert model2.out.weight is model2.emb.weight  # type: ignore[union-attr]
    moment = optimizer2.state_dict()["state"][0]["exp_avg"]
    assert moment.untyped_storage().nbytes() == moment.nbytes, "loaded moments own their memory"
    merged = safetensors.torch.load_file(str(consolidate(path, tmp_path / "all.safetensors")))
    assert torch.equal(merged["out.weight"], want["model.emb.weight"])


@pytest.mark.timeout(10)
@pytest.mark.usefixtures("small_shards")
@pytest.mark.parametrize("where", ["header", "middle"])
def test_a_damaged_shard_is_refused_by_name_and_changes_nothing(rig: torchrig.Rig, tmp_path: Path, where: str) -> None:
    model, optimizer = trained(rig, seed=0)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer})
    name = next(n for n in sorted(json.loads((path / "meta.json").read_text())["files"]) if "@tensors" in n)
    data = bytearray((path / name).read_bytes())
    data[3 if where == "header" else len(data) - 40] ^= 0xFF
    (path / name).write_bytes(bytes(data))
    before = flat(model, optimizer)
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in .*{name}: SHA-256 is [0-9a-f]{{64}}"):
        rig.load(path, {"model": model, "optimizer": optimizer})
    after = flat(model, optimizer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a damaged checkpoint must change nothing"


@pytest.mark.timeout(10)
def test_format_1_checkpoints_still_load(rig: torchrig.Rig, tmp_path: Path) -> None:
    model, optimizer = trained(rig, seed=0)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 5})
    # Rewrite it as torchrig wrote checkpoints before shards: one "file" per module, no "external".
    meta = json.loads((path / "meta.json").read_text())
    blob = torch.load(path / "state.pt", weights_only=True)
    assert blob.pop("external") == {"files": [], "where": []}
    buf = io.BytesIO()
    torch.save(blob, buf)
    (path / "state.pt").write_bytes(buf.getvalue())
    meta["version"] = 1
    del meta["entries"]["model"]["files"]
    meta["files"]["state.pt"] = {"size": len(buf.getvalue()), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    (path / "meta.json").write_text(json.dumps(meta))

    want = flat(model, optimizer)
    model2, optimizer2 = trained(rig, seed=1, steps=1)
    assert rig.load(path, {"model": model2, "optimizer": optimizer2})["step"] == 5
    got = flat(model2, optimizer2)
    assert all(torch.equal(got[k], want[k]) for k in want)
