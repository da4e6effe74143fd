"""Loading never runs code and refuses damaged files; saving fails loudly and keeps the old checkpoint."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError, files

MARKER_NAME = "payload-ran"


class Payload:
    """Unpickling this creates a file: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


class Opaque:
    """A user object without state_dict(): weights_only loading could not rebuild it."""


@pytest.fixture
def rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


def _resign(path: Path, name: str) -> None:
    """Rewrite meta.json so the checksum matches a replaced file (what an attacker would do)."""
    meta = json.loads((path / "meta.json").read_text())
    data = (path / name).read_bytes()
    meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.timeout(10)
def test_a_pickle_payload_is_refused_and_never_runs(rig: torchrig.Rig, tmp_path: Path) -> None:
    model = rig.prepare(nn.Linear(2, 2))
    path = rig.save(tmp_path / "ck", {"model": model, "step": 1})
    marker = tmp_path / MARKER_NAME
    buf = io.BytesIO()
    torch.save({"objects": {}, "values": {"step": Payload(marker)}, "module_extras": {}, "rng": []}, buf)
    (path / "state.pt").write_bytes(buf.getvalue())
    _resign(path, "state.pt")
    with pytest.raises(CheckpointError, match=r"refusing to load .*state\.pt: it holds Python objects"):
        rig.load(path, {"model": model})
    assert not marker.exists(), "the payload ran"
    # The check was real: the same bytes do run the payload when unpickled without protection.
    with zipfile.ZipFile(path / "state.pt") as z:
        pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
        import pickle

        pickle.loads(z.read(pkl))
    assert marker.exists()


@pytest.mark.timeout(10)
def test_unsafe_values_are_refused_at_save_time(rig: torchrig.Rig, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cannot be loaded safely: test_checkpoint_safety.Opaque"):
        rig.save(tmp_path / "ck", {"step": 1, "thing": Opaque()})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
def test_truncated_or_altered_files_are_refused_by_name(rig: torchrig.Rig, tmp_path: Path, name: str) -> None:
    model = rig.prepare(nn.Linear(8, 8))
    path = rig.save(tmp_path / "ck", {"model": model, "step": 1})
    data = bytearray((path / name).read_bytes())
    (path / name).write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=rf"{name} is {len(data) - 10} bytes but meta.json says {len(data)}"):
        rig.load(path, {"model": model})
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    (path / name).write_bytes(bytes(data))
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in .*{name}: SHA-256 is [0-9a-f]{{64}}"):
        rig.load(path, {"model": model})
    assert torch.equal(model.weight, before), "a damaged checkpoint must change nothing"


@pytest.mark.timeout(10)
def test_a_directory_without_meta_is_not_a_checkpoint(rig: torchrig.Rig, tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is not a torchrig checkpoint: it has no meta\.json"):
        rig.load(tmp_path / "half")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        rig.load(tmp_path / "nothing")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "error", [OSError(errno.ENOSPC, "No space left on device"), PermissionError(errno.EACCES, "Permission denied")]
)
def test_write_errors_are_raised_and_the_previous_checkpoint_stays(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: OSError
) -> None:
    model = rig.prepare(nn.Linear(2, 2))
    rig.save(tmp_path / "step-1", {"model": model, "step": 1})
    real = files.durable
    calls = []

    def failing(path: Path) -> None:  # what fsync (or the write before it) raises on a full disk
        calls.append(path.name)
        if len(calls) == 2:  # one file is written, the other fails
            raise error
        real(path)

    monkeypatch.setattr(files, "durable", failing)
    # A full disk is a CheckpointError saying so (tests/unit/test_checkpoint_hostile_files.py); any other
    # failure is one saying that nothing was committed, the error it met inside.
    expected = (
        "no space left on device"
        if error.errno == errno.ENOSPC
        else r"saving .*step-2 failed before the checkpoint was committed \(PermissionError: \[Errno 13\] Permission "
        r"denied\); nothing was replaced \(the previous checkpoint and the link are as they were\)"
    )
    with pytest.raises(CheckpointError, match=expected):
        rig.save(tmp_path / "step-2", {"model": model, "step": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-1"]  # no temp dir, no step-2
    assert rig.load(tmp_path / "last")["step"] == 1


@pytest.mark.timeout(10)
def test_stale_temp_dirs_of_dead_saves_are_removed(rig: torchrig.Rig, tmp_path: Path) -> None:
    mine = files.temp_dir_for(tmp_path / "step-1")  # named for this host, boot and pid namespace
    dead = tmp_path / mine.name.replace(f"-{os.getpid()}-", "-999999999-")  # no such pid
    dead.mkdir()
    rig.save(tmp_path / "step-2", {"step": 2})
    assert not dead.exists() and mine.exists()


@pytest.mark.timeout(20)
def test_dcp_metadata_and_byte_items_never_run_code(tmp_path: Path) -> None:
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from torchrig.checkpoint.dcp_safe import parse_dcp_metadata, safe_planner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised
        model = nn.Linear(2, 2)
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "good")
        good = tmp_path / "good" / ".metadata"
        parse_dcp_metadata(good, good.read_bytes(), files={"__0_0.distcp"})  # a real one passes

        marker = tmp_path / MARKER_NAME
        (tmp_path / "evil.metadata").write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(CheckpointError, match=r"refusing to load .*evil\.metadata: it names the Python object"):
            evil = tmp_path / "evil.metadata"
            parse_dcp_metadata(evil, evil.read_bytes(), files={"__0_0.distcp"})
        assert not marker.exists()

        # A non-tensor item carrying a payload: DCP's own planner would unpickle it unrestricted.
        dcp.save({"extra": Payload(marker)}, checkpoint_id=tmp_path / "bytes")
        assert not marker.exists()
        from torch.distributed.checkpoint.api import CheckpointException

        with pytest.raises(CheckpointException, match="Weights only load failed"):
            dcp.load({"extra": None}, checkpoint_id=tmp_path / "bytes", planner=safe_planner())
        assert not marker.exists()
