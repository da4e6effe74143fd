"""``torchrig checkpoint inspect`` and ``torchrig checkpoint consolidate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import torchrig
from torchrig.checkpoint.errors import DamagedCheckpointError
from torchrig.cli import main


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3)
        self.out = nn.Linear(3, 6, bias=False)
        self.out.weight = self.emb.weight


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    rig = torchrig.Rig(accelerator="cpu")
    model = rig.prepare(Tied())
    optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    return rig.save(tmp_path / "step-12", {"model": model, "optimizer": optimizer, "step": 12, "epoch": 3})


@pytest.mark.timeout(10)
def test_inspect_prints_contents_and_verifies(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "inspect", str(saved.parent / "last")]) == 0
    out = capsys.readouterr().out
    for text in ("step-12", "world size", "│ 12", "│ 3 ", "torch " + torch.__version__, "model.safetensors", "ok"):
        assert text in out, text
    assert "18" in out  # parameters: the tied 6x3 matrix, once
    assert "torch.optim.sgd.SGD" in out

    data = bytearray((saved / "state.pt").read_bytes())
    data[-40] ^= 1
    (saved / "state.pt").write_bytes(bytes(data))
    assert main(["checkpoint", "inspect", str(saved)]) == 1  # damaged: exit 1, not a usage error's 2
    assert "MISMATCH" in capsys.readouterr().out
    assert main(["checkpoint", "consolidate", str(saved), str(saved.parent / "w.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"torchrig checkpoint consolidate: checksum mismatch in {saved / 'state.pt'}: SHA-256 is ")
    assert err.count("\n") == 1 and "the file was altered or corrupted" in err


@pytest.mark.timeout(10)
def test_consolidate_writes_one_self_contained_file(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "export" / "model.safetensors"
    assert main(["checkpoint", "consolidate", str(saved), str(out)]) == 0
    tensors = safetensors.torch.load_file(str(out))
    assert set(tensors) == {"emb.weight", "out.weight"}  # tied weights get their own copy here
    fresh = Tied()
    fresh.load_state_dict(tensors)
    assert torch.equal(fresh.out.weight, tensors["emb.weight"])


@pytest.mark.timeout(10)
def test_usage_errors_are_one_prefixed_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"torchrig checkpoint inspect: no checkpoint at {tmp_path / 'nope'}\n"
    (tmp_path / "w.safetensors").write_bytes(b"not a checkpoint")
    assert main(["checkpoint", "consolidate", str(tmp_path / "w.safetensors"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchrig checkpoint consolidate: {tmp_path / 'w.safetensors'} is a file, but a torchrig")
    assert err.count("\n") == 1
    assert main(["checkpoint", "import", str(tmp_path / "nope.ckpt"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchrig checkpoint import: ") and str(tmp_path / "nope.ckpt") in err, err
    assert err.count("\n") == 1
    assert main(["checkpoint"]) == 2


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(20)
def test_consolidate_refuses_an_out_it_cannot_write_and_leaves_everything_as_it_was(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "my files ü"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's")
    before = _listing(tmp_path)
    cases = [
        (folder, f"torchrig checkpoint consolidate: out={str(folder)!r} is a directory; give the file to write, "),
        (folder / "notes.txt" / "w.safetensors", "exists and is not a directory"),
        (saved / "model.safetensors", f"is inside the checkpoint {saved.resolve()} it reads, whose files are checked"),
        (saved.parent / "last" / "w.safetensors", "is inside the checkpoint"),  # through the link
    ]
    for out, error in cases:
        assert main(["checkpoint", "consolidate", str(saved), str(out)]) == 2  # a usage error
        err = capsys.readouterr().err
        assert error in err and err.count("\n") == 1, err
        assert _listing(tmp_path) == before, out  # no temporary file left, the checkpoint unchanged
    assert main(["checkpoint", "inspect", str(saved)]) == 0


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process
def test_a_damaged_shard_is_damage_exit_1_and_a_damaged_checkpoint_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # DCP gathers each rank's refusal of its shards; it used to come back as a plain CheckpointError
    # (exit 2, "not the kind of file the action takes") instead of the damage it is.
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model = rig.prepare(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    saved = rig.save(tmp_path / "ck", {"model": model, "step": 1})
    shard = saved / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["checkpoint", "consolidate", str(saved), str(tmp_path / "w.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"torchrig checkpoint consolidate: checksum mismatch in {shard}: SHA-256 is "), err
    with pytest.raises(DamagedCheckpointError, match=r"^checksum mismatch in .*__0_0\.distcp"):
        rig.load(saved, {"model": model})
