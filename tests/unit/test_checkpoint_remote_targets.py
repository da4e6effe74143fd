"""What a save to object storage may write over, and what retention may delete there: only a new
name or a torchrig checkpoint (its ``v-<ordinal>-<random>/`` versions), and a ``last`` that is
missing or a torchrig link object. A prefix holding the user's objects, or the user's own object
named ``last``, is refused before anything is uploaded (as a local folder of the user's is), and
retention never deletes an object it did not write (fsspec's in-memory store; the same against a
real S3 server: test_checkpoint_s3.py).
"""

from __future__ import annotations

from typing import Any

import pytest

import torchrig
from conftest import trained_mlp
from torchrig.checkpoint import CheckpointError

fsspec = pytest.importorskip("fsspec")


def _fs() -> Any:
    return fsspec.filesystem("memory")


def _listing(path: str) -> dict[str, bytes]:
    """Every object under ``path`` with its bytes."""
    return {p: bytes(_fs().cat_file(p)) for p in sorted(_fs().find(path))}


def test_a_prefix_holding_the_users_objects_is_refused_and_kept(memory_url: str) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model, _ = trained_mlp(0)
    path = memory_url.removeprefix("memory://")
    rig.save(f"{memory_url}/step-1", {"model": model, "step": 1})
    _fs().pipe_file(f"{path}/results/metrics.csv", b"epoch,loss\n0,1.5\n")
    _fs().pipe_file(f"{path}/results/plots/loss.png", b"\x89PNG")
    before = _listing(path)
    for blocking in (True, False):  # a background save is refused in the call
        with pytest.raises(CheckpointError) as err:
            rig.save(f"{memory_url}/results", {"model": model, "step": 2}, blocking=blocking)
        assert str(err.value) == (
            f"cannot save to {memory_url}/results: the prefix {memory_url}/results/ holds objects that are not a "
            "torchrig checkpoint's ('metrics.csv', 'plots'); only a new name or a torchrig checkpoint (its "
            "v-<ordinal>-<random>/ versions) is replaced: give a new name such as 'step-000100', or remove them "
            "yourself"
        )
        assert _listing(path) == before  # nothing uploaded, `last` not moved
    assert rig.load(f"{memory_url}/last")["step"] == 1


def test_retention_deletes_only_the_versions_it_wrote(memory_url: str) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model, _ = trained_mlp(0)
    path = memory_url.removeprefix("memory://")
    rig.save(f"{memory_url}/step-1", {"model": model, "step": 1})
    _fs().pipe_file(f"{path}/step-1/NOTES.md", b"why this run diverged")  # the user's, added after the save
    rig.save(f"{memory_url}/step-2", {"model": model, "step": 2})
    rig.save(f"{memory_url}/step-3", {"model": model, "step": 3}, keep_last=1)
    assert sorted(_fs().find(f"{path}/step-1")) == [f"{path}/step-1/NOTES.md"]
    assert _fs().cat_file(f"{path}/step-1/NOTES.md") == b"why this run diverged"
    assert not _fs().exists(f"{path}/step-2")  # nothing of it left, not even its folder
    assert rig.load(f"{memory_url}/last")["step"] == 3


def test_the_users_object_named_last_is_never_overwritten(memory_url: str) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model, _ = trained_mlp(0)
    path = memory_url.removeprefix("memory://")
    _fs().pipe_file(f"{path}/last", b"the last epoch's notes\n")
    for blocking in (True, False):
        with pytest.raises(CheckpointError) as err:
            rig.save(f"{memory_url}/step-1", {"model": model, "step": 1}, blocking=blocking)
        assert str(err.value) == (
            f"cannot update the 'last' link: {memory_url}/last is an object that is not a torchrig link object "
            "(JSON {'checkpoint': NAME}), it holds something else; remove it or pass link=None"
        )
        assert _listing(path) == {f"{path}/last": b"the last epoch's notes\n"}
    assert rig.save(f"{memory_url}/step-1", {"model": model, "step": 1}, link=None) == f"{memory_url}/step-1"
    assert _fs().cat_file(f"{path}/last") == b"the last epoch's notes\n"
