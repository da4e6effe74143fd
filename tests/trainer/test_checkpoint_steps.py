"""ModelCheckpoint saves whole optimizer steps only, and ``last`` always holds the fit's end (issue 28, item 3);
the epoch a checkpoint records and inspect shows is the one its name shows (issue 29)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer

import torchrig
from torchrig.cli import main


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


@pytest.mark.timeout(60)
def test_inspect_shows_the_epoch_of_the_checkpoint_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints saved inside an epoch, at an epoch's end and at the end of the fit (between
    epochs: the loop has counted the last epoch finished) record in meta.json the ``E`` of their
    name ``epoch=E-step=S``, and ``torchrig checkpoint inspect`` prints it saying how it counts.
    The end-of-fit save used to record the finished epochs (3) under the name epoch=2."""
    every_5 = {"every_n_train_steps": 5, "save_top_k": -1, "save_last": True}
    folders = {
        "steps": torchrig.ModelCheckpoint(dirpath=tmp_path / "steps", **every_5),  # type: ignore[arg-type]
        "epochs": torchrig.ModelCheckpoint(dirpath=tmp_path / "epochs", save_top_k=-1),
        "timed": torchrig.ModelCheckpoint(dirpath=tmp_path / "timed", train_time_interval=3600),  # the fit's end only
    }
    trainer = quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=list(folders.values()))
    trainer.fit(Regressor(), loader(16))  # 4 steps an epoch
    names = {folder: _saved(tmp_path / folder) for folder in folders}
    assert names == {
        "steps": ["epoch=1-step=5", "epoch=2-step=10", "epoch=2-step=12"],  # the last: the fit's end
        "epochs": ["epoch=0-step=4", "epoch=1-step=8", "epoch=2-step=12"],
        "timed": ["epoch=2-step=12"],
    }
    for folder, saved in names.items():
        for name in saved:
            path = tmp_path / folder / name
            epoch = int(name.split("-")[0].removeprefix("epoch="))
            assert torchrig.checkpoint.read_summary(path)["epoch"] == epoch, path
            assert main(["checkpoint", "inspect", str(path)]) == 0
            rows = [line for line in capsys.readouterr().out.splitlines() if "│ epoch " in line]
            assert len(rows) == 2, rows  # the summary, and the entry in the entries table
            assert f"│ {epoch} (counted from 0: the epoch of its last step) │" in rows[0], rows
            assert f"│ builtins.int {epoch} " in rows[1], rows
