"""ModelCheckpoint's retention deletes only what it wrote in its own folder (issue 15, item 2).

A resumed fit takes the kept list back only when the checkpoint was written for the same
folder; whatever a checkpoint's plain data lists, nothing outside the folder, no link, nothing
that is not a checkpoint and never the checkpoint the fit resumed from is removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig.checkpoint import CheckpointURL


class EpochScore(Regressor):
    """Logs ``score`` = the epoch number: later epochs rank higher with ``mode="max"``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("score", float(self.trainer.current_epoch))
        return super().training_step(batch, batch_idx)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _fit(
    folder: Path | str, epochs: int, ckpt_path: Any = None, *, root: Path | None = None, **ckpt: Any
) -> torchrig.ModelCheckpoint:
    cb = torchrig.ModelCheckpoint(dirpath=folder, **ckpt)
    root = root or Path(folder).parent  # the Trainer's own folder (a URL's: given)
    trainer = quiet_trainer(root, max_epochs=epochs, enable_checkpointing=True, callbacks=[cb])
    trainer.fit(EpochScore(), loader(8), ckpt_path=ckpt_path)
    return cb


@pytest.mark.timeout(30)
def test_continuing_a_run_in_another_folder_keeps_the_first_runs_checkpoint(tmp_path: Path) -> None:
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    _fit(run_a, 2, save_last=True)
    assert _names(run_a) == ["epoch=1-step=4", "last"]
    cb = _fit(run_b, 4, ckpt_path=run_a / "last", save_last=True)
    # Run B's retention knows nothing of run A's folder: A is as it was, B keeps its newest.
    assert _names(run_a) == ["epoch=1-step=4", "last"]
    assert (run_a / "epoch=1-step=4" / "meta.json").is_file()
    assert _names(run_b) == ["epoch=3-step=8", "last"]
    assert cb.best_model_path == str((run_b / "epoch=3-step=8").resolve())


@pytest.mark.timeout(30)
def test_a_checkpoint_listing_other_folders_deletes_none_of_them(tmp_path: Path, monkeypatch: Any) -> None:
    folder = tmp_path / "ckpts"
    victim, relative_victim = tmp_path / "victim", tmp_path / "relative_victim"
    for d in (victim, relative_victim, folder / "notes"):
        d.mkdir(parents=True)
        (d / "keep.txt").write_text("precious")
    (victim / "meta.json").write_text("{}")  # looks like a checkpoint, but lies outside the folder
    (folder / "link").symlink_to(victim)
    cb = torchrig.ModelCheckpoint(dirpath=folder, save_last=True)
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[cb])
    trainer.fit(EpochScore(), loader(8))
    # A checkpoint whose plain data lists, for this very folder, what retention must not touch.
    hostile = [str(victim), "relative_victim", str(folder / "notes"), str(folder / "link"), str(folder)]
    cb._saved += hostile
    cb.best_k_models.update(dict.fromkeys(hostile, 0.0))
    trainer.save_checkpoint(folder / "crafted", link=None)
    monkeypatch.chdir(tmp_path)
    _fit(folder, 3, ckpt_path=folder / "crafted", save_last=True)
    for d in (victim, relative_victim, folder / "notes"):
        assert (d / "keep.txt").read_text() == "precious"
    assert (folder / "link").is_symlink()
    # The newest is kept; the one resumed from stays too; the first run's (this folder's) went.
    assert _names(folder) == ["crafted", "epoch=2-step=6", "last", "link", "notes"]


@pytest.mark.timeout(40)
def test_top_k_retention_goes_on_across_a_resume_in_the_same_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    kw: dict[str, Any] = {"monitor": "score", "mode": "max", "save_top_k": 2, "save_last": True}
    _fit(folder, 3, **kw)
    assert _names(folder) == ["epoch=1-step=4", "epoch=2-step=6", "last"]
    assert (folder / "last").resolve().name == "epoch=2-step=6"
    cb = _fit(folder, 5, ckpt_path="last", **kw)
    # The resumed run ranks against the kept list it took back: epoch 1 (written by the first
    # run) is removed; epoch 2 falls out of the top 2 but is the checkpoint it resumed from.
    assert _names(folder) == ["epoch=2-step=6", "epoch=3-step=8", "epoch=4-step=10", "last"]
    assert cb.best_model_path == str((folder / "epoch=4-step=10").resolve()) and cb.best_model_score == 4.0
    assert sorted(Path(p).name for p in cb.best_k_models) == ["epoch=3-step=8", "epoch=4-step=10"]


@pytest.mark.timeout(30)
def test_keep_newest_retention_goes_on_across_a_resume_in_the_same_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    _fit(folder, 2)
    first = _names(folder)
    _fit(folder, 2, ckpt_path=folder / first[0])  # nothing left to train: nothing saved, nothing removed
    assert _names(folder) == first == ["epoch=1-step=4"]
    _fit(folder, 4, ckpt_path=folder / "epoch=1-step=4")
    assert _names(folder) == ["epoch=1-step=4", "epoch=3-step=8"]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("where", ["local", "object storage"])
def test_a_new_run_in_the_same_folder_never_replaces_the_earlier_runs_checkpoints(
    tmp_path: Path, memory_url: str, where: str
) -> None:
    # The second run used to save its epoch=1-step=4 over the first run's, which was lost.
    import fsspec

    folder: Any = tmp_path / "ckpts" if where == "local" else CheckpointURL(f"{memory_url}/ckpts")
    first = _fit(folder, 2, root=tmp_path, save_last=True)  # saves epoch=0-step=2, keeps epoch=1-step=4 (save_top_k=1)
    kept = torchrig.checkpoint.module_weights(first.last_model_path)
    torch.manual_seed(7)
    second = _fit(folder, 2, root=tmp_path, save_last=True)  # a new run, not resumed: the same names come up
    if where == "local":
        names = _names(folder)
    else:
        fs = fsspec.filesystem("memory")
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder.removeprefix("memory://"), detail=False))
    assert names == ["epoch=1-step=4", "epoch=1-step=4-v1", "last"]  # its own epoch 0 went, not the first run's
    assert second.last_model_path == str(folder / "epoch=1-step=4-v1") == second.best_model_path
    for name, weights in torchrig.checkpoint.module_weights(str(folder / "epoch=1-step=4")).items():
        assert all(torch.equal(t, kept[name][k]) for k, t in weights.items())  # the first run's, as it was
    assert torchrig.checkpoint.read_values(str(folder / "last"))["step"] == 4
