"""The Trainer's checkpoints on object storage (fsspec's in-memory store): ModelCheckpoint(dirpath=URL),
ckpt_path="last" and ckpt_path=URL resume exactly, retention deletes only what the callback wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer

import torchrig

fsspec = pytest.importorskip("fsspec")


def _fit(
    tmp: Path, url: str, epochs: int, ckpt_path: str | None = None, strategy: str = "auto"
) -> tuple[torchrig.ModelCheckpoint, Regressor]:
    torch.manual_seed(0)
    cb = torchrig.ModelCheckpoint(dirpath=url, save_last=True)
    trainer = quiet_trainer(tmp, max_epochs=epochs, enable_checkpointing=True, callbacks=[cb], strategy=strategy)
    module = Regressor()
    trainer.fit(module, loader(16, shuffle=True), ckpt_path=ckpt_path)
    return cb, module


def _whole(module: Regressor) -> list[torch.Tensor]:
    """The module's parameters, whole (an FSDP-sharded one gathered)."""
    return [getattr(p, "full_tensor", p.detach)() for p in params(module)]


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])  # whole checkpoints, and sharded ones through DCP
def test_a_fit_resumes_from_object_storage_exactly(tmp_path: Path, memory_url: str, strategy: str) -> None:
    _, whole = _fit(tmp_path / "whole", f"{memory_url}/whole", 4, strategy=strategy)
    cb, _ = _fit(tmp_path / "a", f"{memory_url}/run", 2, strategy=strategy)
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{memory_url.removeprefix('memory://')}/run", detail=False))
    assert names == ["epoch=1-step=8", "last"]  # save_top_k=1: epoch 0's checkpoint was removed
    assert cb.last_model_path == f"{memory_url}/run/epoch=1-step=8"
    assert torchrig.checkpoint.describe(cb.last_model_path)["sharded"] is (strategy == "fsdp")
    again_path = f"{memory_url}/run/epoch=1-step=8"
    _, again = _fit(tmp_path / "c", f"{memory_url}/other", 4, ckpt_path=again_path, strategy=strategy)
    assert all(torch.equal(a, b) for a, b in zip(_whole(whole), _whole(again), strict=True))
    _, resumed = _fit(tmp_path / "b", f"{memory_url}/run", 4, ckpt_path="last", strategy=strategy)
    assert all(torch.equal(a, b) for a, b in zip(_whole(whole), _whole(resumed), strict=True))
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{memory_url.removeprefix('memory://')}/run", detail=False))
    assert names == ["epoch=3-step=16", "last"]  # the resumed fit's retention removed what the callback wrote


def test_default_root_dir_on_object_storage_is_refused_with_the_way(memory_url: str) -> None:
    with pytest.raises(ValueError, match=r"logs are written to a local folder; .*ModelCheckpoint\(dirpath='memory://"):
        torchrig.Trainer(default_root_dir=memory_url, accelerator="cpu")


def test_model_checkpoint_keeps_the_users_objects_in_its_folder(tmp_path: Path, memory_url: str) -> None:
    fs = fsspec.filesystem("memory")
    run = f"{memory_url.removeprefix('memory://')}/run"
    fs.pipe_file(f"{run}/config.yaml", b"lr: 0.1\n")  # the user's, beside the checkpoints
    _fit(tmp_path / "a", f"{memory_url}/run", 1)
    fs.pipe_file(f"{run}/epoch=0-step=4/NOTES.md", b"mine")  # the user's, put inside a checkpoint's name
    cb, _ = _fit(tmp_path / "b", f"{memory_url}/run", 2, ckpt_path="last")  # save_top_k=1 drops epoch 0's
    assert cb.last_model_path == f"{memory_url}/run/epoch=1-step=8"
    assert sorted(fs.find(f"{run}/epoch=0-step=4")) == [f"{run}/epoch=0-step=4/NOTES.md"]  # only its versions went
    assert fs.cat_file(f"{run}/config.yaml") == b"lr: 0.1\n"
    assert fs.cat_file(f"{run}/epoch=0-step=4/NOTES.md") == b"mine"

    fs.pipe_file(f"{run}/epoch=2-step=12/README", b"also mine")  # where the next save goes: refused, kept
    with pytest.raises(torchrig.checkpoint.CheckpointError) as err:
        _fit(tmp_path / "c", f"{memory_url}/run", 3, ckpt_path="last")
    assert str(err.value).startswith(
        f"cannot save to {memory_url}/run/epoch=2-step=12: the prefix {memory_url}/run/epoch=2-step=12/ holds objects "
        "that are not a torchrig checkpoint's ('README'); only a new name or a torchrig checkpoint"
    )
    assert fs.cat_file(f"{run}/epoch=2-step=12/README") == b"also mine"
    assert fs.cat_file(f"{run}/last") == b'{"checkpoint": "epoch=1-step=8"}'  # not moved
    assert torchrig.checkpoint.describe(f"{memory_url}/run/last")["step"] == 8
