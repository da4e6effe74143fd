"""What ``rig.save`` and ``ModelCheckpoint`` may replace (issue 28, item 1 and the save-target fuzz).

Only a missing path or a real torchrig checkpoint (a directory, not a link, holding our
``meta.json``) is written; anything else is refused with a ``CheckpointError`` naming the path
and what is there, before anything is written: a listing of the folder with every file's hash
is the same before and after.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig.checkpoint import CheckpointError


def listing(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): its kind, a link's target, a file's SHA-256."""
    out: dict[str, str] = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            p = Path(folder, name)
            mode = p.lstat().st_mode
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(mode):
                out[rel] = "link -> " + os.readlink(p)
            elif stat.S_ISREG(mode):
                out[rel] = "file " + hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISDIR(mode):
                out[rel] = "dir"
            else:
                out[rel] = f"other {stat.S_IFMT(mode)}"
    return out


def _checkpoint(path: Path, step: int) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    rig.save(path, {"model": nn.Linear(2, 2), "step": step}, link=None)


# name -> (makes the thing at box/t, whether a save may write there, what the error says is there)
KINDS: dict[str, tuple[Callable[[Path], None], bool, str]] = {
    "missing": (lambda box: None, True, ""),
    "empty dir": (lambda box: (box / "t").mkdir(), False, r"a directory that is not a torchrig checkpoint"),
    "other dir": (
        lambda box: ((box / "t").mkdir(), (box / "t" / "results.csv").write_text("1,2\n")),
        False,
        r"a directory that is not a torchrig checkpoint",
    ),
    "checkpoint": (lambda box: _checkpoint(box / "t", 1), True, ""),
    "file": (lambda box: (box / "t").write_text("notes"), False, r"a regular file"),
    "fifo": (lambda box: os.mkfifo(box / "t"), False, r"a named pipe \(FIFO\)"),
    "link to missing": (lambda box: (box / "t").symlink_to("nowhere"), False, r"a symbolic link \(to 'nowhere'\)"),
    "link to dir": (
        lambda box: ((box / "d").mkdir(), (box / "d" / "x").write_text("x"), (box / "t").symlink_to("d")),
        False,
        r"a symbolic link \(to 'd'\)",
    ),
    "link to checkpoint": (
        lambda box: (_checkpoint(box / "step-2", 2), (box / "t").symlink_to("step-2")),
        False,
        r"a symbolic link \(to 'step-2'\)",
    ),
    "link to empty dir": (
        lambda box: ((box / "e").mkdir(), (box / "t").symlink_to("e")),
        False,
        r"a symbolic link \(to 'e'\)",
    ),
    "link to fifo": (
        lambda box: (os.mkfifo(box / "p"), (box / "t").symlink_to("p")),
        False,
        r"a symbolic link \(to 'p'\)",
    ),
    "link to file": (
        lambda box: ((box / "f").write_text("f"), (box / "t").symlink_to("f")),
        False,
        r"a symbolic link \(to 'f'\)",
    ),
}


def _box(tmp_path: Path, kind: str) -> tuple[Path, dict[str, str]]:
    """``tmp_path/box`` with the ``kind`` of thing at ``box/t``, and its listing."""
    box = tmp_path / "box"
    box.mkdir()
    KINDS[kind][0](box)
    return box, listing(box)


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": nn.Linear(2, 2), "step": step}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", list(KINDS))
def test_rig_save_writes_only_missing_paths_and_checkpoints(tmp_path: Path, kind: str) -> None:
    _, writable, what = KINDS[kind]
    box, before = _box(tmp_path, kind)
    rig = torchrig.Rig(accelerator="cpu")
    if writable:
        rig.save(box / "t", _state(7))
        assert torchrig.checkpoint.read_values(box / "last")["step"] == 7
        after = listing(box)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert all(k == "last" or k == "t" or k.startswith("t/") for k in changed), changed
        return
    for blocking in (True, False):
        with pytest.raises(CheckpointError) as caught:
            handle = rig.save(box / "t", _state(7), blocking=blocking)
            if not blocking:
                handle.wait()  # type: ignore[union-attr]
        message = str(caught.value)
        assert f"cannot save a checkpoint at {box / 't'}: it is " in message
        assert what and re.search(what, message), message
        assert "only a missing path or a torchrig checkpoint" in message
        assert listing(box) == before  # nothing written, nothing hidden, no `last` link


@pytest.mark.timeout(30)
@pytest.mark.parametrize("given", ["", ".", "/"])
def test_rig_save_refuses_the_current_directory_and_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(project)
    before, root_before = listing(tmp_path), sorted(os.listdir("/"))
    with pytest.raises(CheckpointError, match=r"cannot save a checkpoint at .*: it is (a directory|the root)"):
        torchrig.Rig(accelerator="cpu").save(given, _state(1))
    assert listing(tmp_path) == before
    assert sorted(os.listdir("/")) == root_before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "missing"])
def test_model_checkpoint_writes_only_missing_paths_and_checkpoints(tmp_path: Path, kind: str) -> None:
    _, writable, what = KINDS[kind]
    box, before = _box(tmp_path, kind)
    cb = torchrig.ModelCheckpoint(dirpath=box, filename="t", save_top_k=1)
    trainer = quiet_trainer(tmp_path, max_steps=2, enable_checkpointing=True, callbacks=[cb])
    if writable:
        trainer.fit(Regressor(), loader(8))
        # Another run's checkpoint at the name is kept, and this run's goes beside it, as Lightning names it.
        written = box / ("t-v1" if kind == "checkpoint" else "t")
        assert torchrig.checkpoint.read_values(written)["step"] == 2
        if kind == "checkpoint":
            assert torchrig.checkpoint.read_values(box / "t")["step"] == 1
        return
    with pytest.raises(CheckpointError, match=f"cannot save a checkpoint at {box / 't'}: it is {what}"):
        trainer.fit(Regressor(), loader(8))
    assert listing(box) == before


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["empty dir", "other dir", "file", "link to checkpoint"])
@pytest.mark.parametrize("replacing", [False, True])
def test_what_is_put_at_the_path_while_the_files_are_written_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, replacing: bool
) -> None:
    """The target is checked again just before the rename: what the user puts there while the
    files are written (after the first check, before the commit) is refused, never swapped in
    and deleted, and the save's temp directory is removed."""
    from torchrig.checkpoint import files

    box = tmp_path / "box"
    box.mkdir()
    if replacing:  # a checkpoint is at t when the save starts: the first check lets it be replaced
        _checkpoint(box / "t", 1)
    real = files.write_meta
    seen: dict[str, str] = {}

    def meanwhile(tmp: Path, meta: dict[str, Any], target: Path) -> None:
        real(tmp, meta, target)  # every file of the new checkpoint is written; the commit comes next
        if target == box / "t":
            if replacing:
                files.discard(target)
            KINDS[kind][0](box)  # the user's work lands at t
            seen.update({k: v for k, v in listing(box).items() if not k.startswith(".")})

    monkeypatch.setattr(files, "write_meta", meanwhile)
    with pytest.raises(CheckpointError) as caught:
        torchrig.Rig(accelerator="cpu").save(box / "t", _state(7))
    message = str(caught.value)
    assert message.startswith(f"cannot save a checkpoint at {box / 't'}: it is "), message
    assert re.search(KINDS[kind][2], message), message
    assert seen and listing(box) == seen  # the user's thing as it was; no temp directory, no `last`
