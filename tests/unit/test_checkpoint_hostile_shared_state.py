"""A tampered sharded checkpoint never changes process-wide state, even when refused, and what DCP
raises is a CheckpointError (issue 28, item 5)."""

from __future__ import annotations

import hashlib
import json
import pickle
import pickletools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_hostile_sharded import _rewrite_metadata, _trained, sharded_checkpoint  # noqa: F401

import torchrig
from torchrig.checkpoint import CheckpointError
from torchrig.cli import main


@pytest.fixture
def encoding_values() -> Iterator[dict[str, Any]]:
    """DCP's memory-format enum's values, put back after the test whatever it did to them."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    before = {m.name: m._value_ for m in _MEM_FORMAT_ENCODING}
    yield before
    for m in _MEM_FORMAT_ENCODING:
        m._value_ = before[m.name]


class _RebuildMember:
    """Pickled as DCP's enum member, then a BUILD that sets its ``_value_`` to 7."""

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

        member = next(iter(_MEM_FORMAT_ENCODING))
        return (_MEM_FORMAT_ENCODING, (member.value,), {"_value_": 7})


def _plant_build(path: Path, *, resign: bool) -> None:
    """``path/.metadata``: a BUILD onto the enum member, then the real metadata, padded to the listed size."""
    real = (path / ".metadata").read_bytes()
    payload = pickletools.optimize(pickle.dumps(_RebuildMember(), protocol=2))  # no memo: the real one's stays right
    payload = payload[:-1] + b"0"  # ... BUILD, POP (instead of STOP)
    data = payload + real[2:]  # the real pickle after it (its PROTO dropped)
    if not resign:  # same size, different bytes: only the checksum can tell
        data = data[: len(real)] if len(data) >= len(real) else data + b"\0" * (len(real) - len(data))
    (path / ".metadata").write_bytes(data)
    if resign:
        meta = json.loads((path / "meta.json").read_text())
        meta["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (path / "meta.json").write_text(json.dumps(meta))


def _values() -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return {m.name: m._value_ for m in _MEM_FORMAT_ENCODING}


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("resign", [False, True], ids=["checksum mismatch", "meta.json rewritten"])
def test_a_build_onto_an_enum_member_changes_nothing_and_later_saves_work(
    sharded_checkpoint: Path,  # noqa: F811
    tmp_path: Path,
    encoding_values: dict[str, Any],
    resign: bool,
) -> None:
    path = Path(shutil.copytree(sharded_checkpoint, tmp_path / "ck"))
    _plant_build(path, resign=resign)
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _trained(rig, seed=1)
    if resign:
        message = re.escape(f"refusing to load {path / '.metadata'}: it sets attributes of the _MEM_FORMAT_ENCODING ")
    else:
        message = re.escape(f"checksum mismatch in {path / '.metadata'}: SHA-256 is ")
    with pytest.raises(CheckpointError, match=message):
        rig.load(path, {"model": model, "optimizer": optimizer})
    assert _values() == encoding_values, "the checkpoint changed an enum of this process"
    again = rig.save(tmp_path / "after", {"model": model, "optimizer": optimizer, "step": 1})
    assert rig.load(again, {"model": model, "optimizer": optimizer})["step"] == 1


def _transforms(md: Any) -> None:
    for info in md.storage_data.values():
        info.transform_descriptors = ["no-such-transform"]


def _too_long(md: Any) -> None:
    for info in md.storage_data.values():
        info.length += 1 << 20  # past the end of its shard file


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            _transforms,
            "{metadata} asks DCP to decode a shard with the stream transforms ['no-such-transform'], which torchrig "
            "never writes; refusing to read it",
        ),
        (_too_long, "could not read the shards of {folder}: DCP failed on rank 0: "),
    ],
    ids=["crafted transform_descriptors", "what DCP raises while reading"],
)
def test_crafted_shard_entries_are_a_one_line_checkpoint_error(
    sharded_checkpoint: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: Any,
    message: str,
) -> None:
    path = Path(shutil.copytree(sharded_checkpoint, tmp_path / "ck"))
    _rewrite_metadata(path, change)
    message = message.format(metadata=path / ".metadata", folder=path)
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _trained(rig, seed=1)
    before = [p.full_tensor().detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=re.escape(message)):
        rig.load(path, {"model": model, "optimizer": optimizer})
    assert all(torch.equal(a.full_tensor(), b) for a, b in zip(model.parameters(), before, strict=True))
    capsys.readouterr()
    assert main(["checkpoint", "consolidate", str(path), str(tmp_path / "out.safetensors")]) == 2
    out, err = capsys.readouterr()
    assert message in " ".join((out + err).split()) and "Traceback" not in out + err
