"""The Trainer's checkpoints on object storage (fsspec's in-memory store): ModelCheckpoint(dirpath=URL),
ckpt_path="last" and ckpt_path=URL resume exactly, retention deletes only what the callback wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer

import torchrig

fsspec = pytest.importorskip("fsspec")


def _fit(tmp: Path, url: str, epochs: int, ckpt_path: str | None = None) -> tuple[torchrig.ModelCheckpoint, Regressor]:
    torch.manual_seed(0)
    cb = torchrig.ModelCheckpoint(dirpath=url, save_last=True)
    trainer = quiet_trainer(tmp, max_epochs=epochs, enable_checkpointing=True, callbacks=[cb])
    module = Regressor()
    trainer.fit(module, loader(16, shuffle=True), ckpt_path=ckpt_path)
    return cb, module


@pytest.mark.timeout(60)
def test_a_fit_resumes_from_object_storage_exactly(tmp_path: Path, memory_url: str) -> None:
    _, whole = _fit(tmp_path / "whole", f"{memory_url}/whole", 4)
    cb, _ = _fit(tmp_path / "a", f"{memory_url}/run", 2)
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{memory_url.removeprefix('memory://')}/run", detail=False))
    assert names == ["epoch=1-step=8", "last"]  # save_top_k=1: epoch 0's checkpoint was removed
    assert cb.last_model_path == f"{memory_url}/run/epoch=1-step=8"
    _, again = _fit(tmp_path / "c", f"{memory_url}/other", 4, ckpt_path=f"{memory_url}/run/epoch=1-step=8")
    assert all(torch.equal(a, b) for a, b in zip(params(whole), params(again), strict=True))
    _, resumed = _fit(tmp_path / "b", f"{memory_url}/run", 4, ckpt_path="last")
    assert all(torch.equal(a, b) for a, b in zip(params(whole), params(resumed), strict=True))
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{memory_url.removeprefix('memory://')}/run", detail=False))
    assert names == ["epoch=3-step=16", "last"]  # the resumed fit's retention removed what the callback wrote


def test_default_root_dir_on_object_storage_is_refused_with_the_way(memory_url: str) -> None:
    with pytest.raises(ValueError, match=r"logs are written to a local folder; .*ModelCheckpoint\(dirpath='memory://"):
        torchrig.Trainer(default_root_dir=memory_url, accelerator="cpu")
