"""ModelCheckpoint saves whole optimizer steps only, and ``last`` always holds the fit's end (issue 28, item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer

import torchrig


def _fit(root: Path, ckpt: torchrig.ModelCheckpoint | None, ckpt_path: Path | None = None, **kw: object) -> Regressor:
    torch.manual_seed(0)
    module = Regressor()
    callbacks = [ckpt] if ckpt is not None else []
    trainer = quiet_trainer(root, enable_checkpointing=ckpt is not None, callbacks=callbacks, **kw)
    trainer.fit(module, loader(16), ckpt_path=ckpt_path)
    return module


def _saved(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir() if not p.is_symlink()), key=lambda n: int(n.split("step=")[1]))


@pytest.mark.timeout(60)
def test_with_accumulation_checkpoints_are_saved_at_optimizer_steps_and_resume_exactly(tmp_path: Path) -> None:
    # 4 batches an epoch, 2 per optimizer step: steps end after batches 2 and 4 of each epoch.
    settings = {"max_epochs": 2, "accumulate_grad_batches": 2}
    whole = params(_fit(tmp_path / "whole", None, **settings))
    folder = tmp_path / "ck"
    cb = torchrig.ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    _fit(tmp_path / "saving", cb, **settings)
    # Never after the first micro-batch (step 0, half a gradient), once per optimizer step.
    assert _saved(folder) == [f"epoch={s // 3}-step={s}" for s in (1, 2, 3, 4)]
    for name in _saved(folder)[:-1]:
        resumed = _fit(tmp_path / f"from-{name}", None, ckpt_path=folder / name, **settings)
        assert all(torch.equal(a, b) for a, b in zip(whole, params(resumed), strict=True)), name


@pytest.mark.timeout(60)
def test_last_holds_the_final_step_when_it_is_not_a_multiple_of_every_n_train_steps(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    cb = torchrig.ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_last=True)
    _fit(tmp_path, cb, max_steps=10)  # 4 batches an epoch: steps 3, 6, 9 are due, the fit ends at 10
    assert (folder / "last").resolve().name == "epoch=2-step=10"
    assert torchrig.checkpoint.read_values(folder / "last")["step"] == 10
    assert cb.last_model_path == str(folder.resolve() / "epoch=2-step=10")
