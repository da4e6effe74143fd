"""``fit(ckpt_path="last")`` when ``last`` dangles: it recovers the previous copy or raises, never starts over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig.checkpoint import files


@pytest.mark.timeout(20)
def test_a_dangling_last_with_nothing_to_load_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    cb = torchrig.ModelCheckpoint(dirpath=ckpts, filename="{epoch}", every_n_train_steps=2, save_last=True)
    trainer = quiet_trainer(tmp_path, max_steps=4, enable_checkpointing=True, callbacks=[cb])
    trainer.fit(Regressor(), loader(32))
    assert os.readlink(ckpts / "last") == "epoch=0"
    # A replace of epoch=0 killed between its renames: the Trainer resumes from the previous copy.
    os.rename(ckpts / "epoch=0", ckpts / ".epoch=0.old-killed")
    cb = torchrig.ModelCheckpoint(dirpath=ckpts, filename="{epoch}", every_n_train_steps=2, save_last=True)
    trainer = quiet_trainer(tmp_path, max_steps=6, enable_checkpointing=True, callbacks=[cb])
    with pytest.warns(UserWarning, match="a save was interrupted while replacing it"):
        trainer.fit(Regressor(), loader(32), ckpt_path="last")
    assert trainer.run.resumed and trainer.global_step == 6
    # With no copy at all the dangling last is an error naming it, never a silent start from step 0.
    for p in list(ckpts.iterdir()):
        if p.is_dir() and not p.is_symlink():
            files.discard(p)
    assert os.path.islink(ckpts / "last") and not (ckpts / "last").exists()
    cb = torchrig.ModelCheckpoint(dirpath=ckpts, filename="{epoch}", every_n_train_steps=2, save_last=True)
    trainer = quiet_trainer(tmp_path, max_steps=8, enable_checkpointing=True, callbacks=[cb])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*epoch=0"):
        trainer.fit(Regressor(), loader(32), ckpt_path="last")
