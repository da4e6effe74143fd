"""Checkpoint names up to the file system's limit save, replace and load; a longer name is an error
naming the user's path, never a hidden temp path (issue 28, item 8)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError, files


@pytest.mark.timeout(30)
@pytest.mark.parametrize("length", [200, 206, 230, 255])
def test_names_up_to_the_limit_save_replace_and_load(tmp_path: Path, length: int) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model = nn.Linear(2, 2)
    name = ("step-000100-" + "x" * 300)[:length]
    link = "l" * length
    for step in (1, 2):  # a new checkpoint, then one replacing it
        rig.save(tmp_path / name, {"model": model, "step": step}, link=link)
    assert torchrig.checkpoint.read_values(tmp_path / link)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, link])  # no leftovers


@pytest.mark.timeout(30)
def test_the_temp_names_of_a_long_name_fit_and_are_found_again(tmp_path: Path) -> None:
    name = "é" * 127  # 254 bytes in UTF-8
    for kind in ("tmp", "old", "link"):
        made = files.leftover_name(tmp_path / name, kind)
        assert len(os.fsencode(made.name)) <= 255
        assert files._LEFTOVER.fullmatch(made.name) is not None
    # a copy renamed aside while a replace was interrupted is loaded (and put back) by its long name
    rig = torchrig.Rig(accelerator="cpu")
    rig.save(tmp_path / name, {"model": nn.Linear(2, 2), "step": 3}, link=None)
    aside = files.leftover_name(tmp_path / name, "old")
    os.rename(tmp_path / name, aside)
    with pytest.warns(UserWarning, match="a save was interrupted while replacing it"):
        assert rig.load(tmp_path / name)["step"] == 3


@pytest.mark.timeout(30)
def test_a_name_too_long_for_the_file_system_is_an_error_naming_it(tmp_path: Path) -> None:
    name = "n" * 256
    with pytest.raises(
        CheckpointError,
        match=rf"cannot save a checkpoint at {tmp_path / name}: its name is 256 bytes long, and the file system "
        r"allows 255; give a shorter name",
    ):
        torchrig.Rig(accelerator="cpu").save(tmp_path / name, {"model": nn.Linear(2, 2)})
    assert list(tmp_path.iterdir()) == []
