"""Sharded (FSDP, DCP) checkpoints on object storage, on fsspec's in-memory store in one process:
DCP's fsspec writer uploads the shards under the new version's prefix, hashing each file on its
way, rank zero adds ``state.pt`` and ``meta.json`` last; a death at any change keeps ``last``
loadable. Two real processes against a real S3 server: test_checkpoint_s3.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError

fsspec = pytest.importorskip("fsspec")
from test_checkpoint_remote import _die_at, _Died  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(90)]  # FSDP in one process

# What a sharded save changes on the store: DCP opens its files for writing and renames its
# ``.metadata.tmp`` (a copy and a delete); rank zero's ``state.pt`` and ``meta.json`` are written
# through ``_open`` too (``put_file``), the ``last`` object by ``pipe_file``; older versions go.
SHARDED_CHANGES = ("_open", "cp_file", "pipe_file", "rm_file", "rmdir")


def _fs() -> Any:
    return fsspec.filesystem("memory")


def _fsdp(rig: torchrig.Rig, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model sharded by FSDP and its AdamW after one step (its moments exist), from ``seed``."""
    torch.manual_seed(seed)
    model = rig.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    rig.backward(model(torch.randn(3, 4)).square().mean())
    optimizer.step()
    return model, optimizer


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every weight and optimizer moment of a sharded model, whole."""
    tensors = [t.full_tensor() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [t.full_tensor() if hasattr(t, "full_tensor") else t for t in state.values()]
    return tensors


def _version(url: str) -> str:
    (version,) = _fs().ls(url.removeprefix("memory://"), detail=False)
    return str(version)


def test_a_sharded_checkpoint_round_trips_with_every_file_hashed_on_upload(memory_url: str, tmp_path: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _fsdp(rig, 0)
    assert rig.save(f"{memory_url}/ck", {"model": model, "optimizer": optimizer, "step": 3}) == f"{memory_url}/ck"

    version = _version(f"{memory_url}/ck")
    meta = json.loads(_fs().cat_file(f"{version}/meta.json"))
    assert meta["sharded"] is True
    assert {".metadata", "__0_0.distcp", "state.pt"} == set(meta["files"])
    stored = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(version, detail=False))
    assert stored == sorted([*meta["files"], "meta.json"])
    for name, entry in meta["files"].items():  # the hashes taken while uploading are the stored bytes'
        data = _fs().cat_file(f"{version}/{name}")
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, name

    other, other_opt = _fsdp(rig, 1)
    assert rig.load(f"{memory_url}/last", {"model": other, "optimizer": other_opt}) == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(_full(model, optimizer), _full(other, other_opt), strict=True))

    weights = load_file(torchrig.checkpoint.consolidate(f"{memory_url}/last", tmp_path / "w.safetensors"))
    assert weights.keys() == model.state_dict().keys()  # one file, read in this process without DCP's group
    assert all(torch.equal(weights[k], v.full_tensor()) for k, v in model.state_dict().items())


def test_a_background_sharded_save_uploads_on_its_thread(memory_url: str) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _fsdp(rig, 0)
    handle = rig.save(f"{memory_url}/ck", {"model": model, "optimizer": optimizer, "step": 4}, blocking=False)
    expected = [t.clone() for t in _full(model, optimizer)]
    optimizer.step()  # waits for the host copy, then changes every weight: not in the checkpoint
    assert handle.wait() == f"{memory_url}/ck"
    other, other_opt = _fsdp(rig, 1)
    assert rig.load(f"{memory_url}/last", {"model": other, "optimizer": other_opt}) == {"step": 4}
    assert all(torch.equal(a, b) for a, b in zip(expected, _full(other, other_opt), strict=True))


def test_a_tampered_shard_object_is_refused_before_anything_changes(memory_url: str) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _fsdp(rig, 0)
    rig.save(f"{memory_url}/ck", {"model": model, "optimizer": optimizer, "step": 3})
    key = f"{_version(f'{memory_url}/ck')}/__0_0.distcp"
    data = bytearray(_fs().cat_file(key))
    data[len(data) // 2] ^= 0xFF
    _fs().pipe_file(key, bytes(data))
    _refused_changing_nothing(
        rig, f"{memory_url}/last", r"checksum mismatch in .*__0_0\.distcp: SHA-256 is .*, meta\.json says"
    )


def _refused_changing_nothing(rig: torchrig.Rig, url: str, match: str) -> None:
    """Loading ``url`` into a new model and optimizer raises a CheckpointError matching ``match``
    and leaves every weight and moment as it was."""
    other, other_opt = _fsdp(rig, 1)
    before = [t.clone() for t in _full(other, other_opt)]
    with pytest.raises(CheckpointError, match=match):
        rig.load(url, {"model": other, "optimizer": other_opt})
    assert all(torch.equal(a, b) for a, b in zip(before, _full(other, other_opt), strict=True))


@pytest.mark.parametrize("damage", ["delete", "truncate"])
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "state.pt"])
def test_a_file_deleted_or_cut_after_the_commit_is_refused_naming_the_stored_object(
    memory_url: str, damage: str, name: str
) -> None:
    # Not the download's FileNotFoundError, nor the local temp copy's path: the object on the store.
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _fsdp(rig, 0)
    rig.save(f"{memory_url}/ck", {"model": model, "optimizer": optimizer, "step": 3})
    version = _version(f"{memory_url}/ck")
    size = json.loads(_fs().cat_file(f"{version}/meta.json"))["files"][name]["size"]
    key = f"{version}/{name}"
    if damage == "delete":
        _fs().rm_file(key)
        fetched = 1 if name.endswith(".distcp") else 2  # state.pt and .metadata first, then the shard DCP reads
        expected = (
            rf"{key} is missing; meta\.json lists it \({size} bytes\): the checkpoint was changed after its "
            rf"commit \(1 missing of the {fetched} files fetched\); load an earlier checkpoint"
        )
    else:
        _fs().pipe_file(key, _fs().cat_file(key)[:-5])
        expected = rf"{key} is {size - 5} bytes but meta\.json says {size}"
    _refused_changing_nothing(rig, f"{memory_url}/last", rf"^memory://{expected}")


@pytest.mark.parametrize("strategy", ["fsdp", "auto"])
def test_a_save_to_a_name_that_is_an_object_is_refused_before_anything_is_written(
    memory_url: str, strategy: str
) -> None:
    # An object store keeps the object ``ck`` beside the prefix ``ck/``: a save there would be
    # unloadable (a load reads the object ``ck`` first). Refused before any upload, whole or sharded.
    rig = torchrig.Rig(accelerator="cpu", strategy=strategy)
    model = _fsdp(rig, 0)[0] if strategy == "fsdp" else nn.Linear(2, 2)
    root = memory_url.removeprefix("memory://")
    _fs().pipe_file(f"{root}/ck", b"notes")
    with pytest.raises(
        CheckpointError,
        match=rf"^cannot save to {memory_url}/ck: an object of that name is there, and it is not a torchrig "
        rf"checkpoint \(one on object storage is the prefix {memory_url}/ck/, its objects under it\); remove the "
        "object or save under another name",
    ):
        rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    assert _fs().find(root) == [f"{root}/ck"] and _fs().cat_file(f"{root}/ck") == b"notes"


def test_a_death_at_every_change_of_a_sharded_save_leaves_last_loadable(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _fsdp(rig, 0)
    state = {"model": model, "optimizer": optimizer}
    steps: list[str] = []
    for k in range(1, 60):
        base = f"{memory_url}/k{k}"
        rig.save(f"{base}/old", {**state, "step": 0}, link=None)
        rig.save(f"{base}/ck", {**state, "step": 1})  # the checkpoint the killed save replaces
        seen: list[str] = []
        with monkeypatch.context() as m:
            _die_at(m, k, seen, SHARDED_CHANGES)
            try:
                rig.save(f"{base}/ck", {**state, "step": 2}, keep_last=1)
                finished = True
            except BaseException as err:  # DCP hands a death inside it on as its CheckpointException
                assert "_Died" in repr(err) or isinstance(err, _Died), err
                finished = False
        # Old or new, never nothing; the new one only once its meta.json was written.
        committed = any(s.startswith("_open") and s.endswith("/meta.json") for s in seen[: k - 1])
        assert torchrig.checkpoint.read_values(f"{base}/last")["step"] == (2 if committed or finished else 1), (k, seen)
        rig.save(f"{base}/ck", {**state, "step": 3})  # the next save tidies what the dead one left under the name
        assert len(_fs().ls(f"{base.removeprefix('memory://')}/ck")) == 1
        assert torchrig.checkpoint.read_values(f"{base}/last")["step"] == 3
        if finished:
            steps = seen
            break
    assert k == len(steps) + 1  # a death at every change of the save was tried
    writes = [s.rsplit("/", 1)[-1] for s in steps if s.startswith("_open")]
    assert writes == ["__0_0.distcp", ".metadata.tmp", "state.pt", "meta.json", "last"]  # the shards, meta.json last
    link = steps.index(next(s for s in steps if s.startswith("pipe_file")))
    assert steps[link - 1].endswith("/meta.json") and steps[link].endswith("/last")  # then the link
    assert any(s.startswith("rm_file") and "/old/" in s for s in steps[link:])  # keep_last=1, after the link
