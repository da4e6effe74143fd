"""Every failure of a save is a CheckpointError saying whether the checkpoint was committed and
whether ``last`` moved (issue 28, item 9), on a real file system out of inodes: a tmpfs mounted
with few inodes (needs root; skipped where mounting is not allowed)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs that holds 64 inodes."""
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=64", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path, leave: int) -> None:
    """Use up the inodes of ``folder``'s file system but ``leave``."""
    (folder / "filler").mkdir()
    made = []
    with contextlib.suppress(OSError):
        while True:
            p = folder / "filler" / str(len(made))
            p.touch()
            made.append(p)
    for p in made[len(made) - leave :] if leave else []:
        p.unlink()
    assert os.statvfs(folder).f_favail == leave


def _inodes(state: dict[str, object], folder: Path) -> int:
    """How many inodes a save of ``state`` takes (measured with a save that is then removed)."""
    before = os.statvfs(folder).f_favail
    torchrig.Rig(accelerator="cpu").save(folder / "probe", state, link=None)
    used = before - os.statvfs(folder).f_favail
    for p in (folder / "probe").iterdir():
        p.unlink()
    (folder / "probe").rmdir()
    return used


@pytest.mark.timeout(30)
def test_out_of_inodes_before_the_commit_says_so_and_changes_nothing(small_fs: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model = nn.Linear(2, 2)
    rig.save(small_fs / "ck" / "step-1", {"model": model, "step": 1})
    _fill(small_fs, 0)
    with pytest.raises(CheckpointError) as caught:
        rig.save(small_fs / "ck" / "step-2", {"model": model, "step": 2})
    message = str(caught.value)
    assert message.startswith(f"no space left on device at {small_fs / 'ck' / 'step-2'}: the file system is out of ")
    assert "inodes (room for new files and directories, see `df -i`: 0 free), not of space (" in message
    assert message.endswith("nothing was replaced (the previous checkpoint and the link are as they were)")
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert sorted(p.name for p in (small_fs / "ck").iterdir()) == ["last", "step-1"]
    assert torchrig.checkpoint.read_values(small_fs / "ck" / "last")["step"] == 1


@pytest.mark.timeout(30)
def test_a_link_that_fails_after_the_commit_says_the_checkpoint_was_committed(small_fs: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model = nn.Linear(2, 2)
    folder = small_fs / "ck"
    rig.save(folder / "step-1", {"model": model, "step": 1})
    need = _inodes({"model": model, "step": 2}, folder)
    _fill(small_fs, need)  # room for the checkpoint, none for the new link
    with pytest.raises(CheckpointError) as caught:
        rig.save(folder / "step-2", {"model": model, "step": 2})
    assert str(caught.value).startswith(
        f"the checkpoint {folder / 'step-2'} was committed, but the 'last' link was not moved to it (OSError: "
        f"[Errno 28] No space left on device"
    )
    assert f"{folder / 'last'} still points at 'step-1'. Load {folder / 'step-2'} by its name" in str(caught.value)
    assert torchrig.checkpoint.read_values(folder / "step-2")["step"] == 2
    assert torchrig.checkpoint.read_values(folder / "last")["step"] == 1


@pytest.mark.timeout(30)
def test_object_storage_staged_on_a_full_disk_says_which_disk_and_changes_nothing(
    small_fs: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint on object storage is staged (saved) and downloaded (loaded) in the temp folder:
    # where that disk is full, the error names it and TMPDIR, and the store is as it was.
    import tempfile

    pytest.importorskip("fsspec")
    rig = torchrig.Rig(accelerator="cpu")
    small, big = nn.Linear(2, 2), nn.Linear(2048, 2048)  # 16.8 MB of weights (16.9 MB saved): more than the 16 MiB disk
    rig.save(f"{memory_url}/ck", {"model": small, "step": 1})
    rig.save(f"{memory_url}/big", {"model": big, "step": 1}, link=None)
    monkeypatch.setattr(tempfile, "tempdir", str(small_fs))
    with pytest.raises(CheckpointError) as caught:
        rig.save(f"{memory_url}/ck", {"model": big, "step": 2})
    message = str(caught.value)
    assert re.match(
        rf"^no space left on device at {re.escape(str(small_fs))}/torchrig-stage-\w+, where {memory_url}/ck is staged "
        r"for its upload \(TMPDIR sets that folder\): the checkpoint needs about 16\.9 MB, [0-9.]+ MB free; nothing "
        r"was replaced \(the previous checkpoint and the link are as they were\)$",
        message,
    ), message
    assert rig.load(f"{memory_url}/last")["step"] == 1
    with pytest.raises(OSError) as failed:
        rig.load(f"{memory_url}/big", {"model": nn.Linear(2048, 2048)})
    assert failed.value.errno == errno.ENOSPC
    assert re.match(
        rf"^\[Errno 28\] no space left on device in {re.escape(str(small_fs))}/torchrig-stage-\w+ for "
        rf"{memory_url}/big/v-\d+-[0-9a-f]+/model\.safetensors \(\d+ bytes\): a checkpoint on object storage is "
        r"downloaded there to be read \(TMPDIR sets that folder\); make room or set TMPDIR to a disk with space$",
        str(failed.value),
    ), str(failed.value)
    assert list(small_fs.iterdir()) == []  # nothing left in the temp folder
