"""Sharded (DCP) checkpoints from a stranger: DCP's ``.metadata`` pickle never runs code, on any path
that reads it; and sharded loads give plain values back in ``state`` like whole ones (issue 14, sections 1, 5)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError
from torchrig.cli import main


def _trained(rig: torchrig.Rig, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = rig.prepare(nn.Linear(4, 3))
    optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _full(model: nn.Module) -> list[torch.Tensor]:
    """The module's tensors, whole (an FSDP parameter is a DTensor)."""
    return [_whole(t).detach().clone() for t in model.state_dict().values()]


# -- section 5: plain values come back in ``state`` for whole and sharded checkpoints ----------------
@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_a_load_updates_the_plain_values_of_state(tmp_path: Path, strategy: str) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy=strategy)
    model, optimizer = _trained(rig, seed=0)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 7, "best": {"loss": 0.5}})
    assert json.loads((path / "meta.json").read_text())["sharded"] is (strategy == "fsdp")
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "best": None}
    left = rig.load(path, state)
    assert state["step"] == 7 and state["best"] == {"loss": 0.5}
    assert left["step"] == 7 and state["model"] is model and state["optimizer"] is optimizer


# -- section 1: DCP's .metadata is read without running anything it names ------------------------------
class _Opens:
    """Unpickled by ``torch.load(weights_only=False)``, this creates ``marker``: code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _call(module: str, name: str, *args: str) -> bytes:
    """Pickle opcodes that call ``module``/``name`` (looked up as pickle protocol 4 does) and drop the result."""
    out = b"c" + f"{module}\n{name}\n".encode()  # GLOBAL
    for arg in args:
        data = arg.encode()
        out += b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE
    return out + {1: b"\x85", 2: b"\x86"}[len(args)] + b"R0"  # TUPLE1/TUPLE2, REDUCE, POP


def _payload(kind: str, folder: Path, marker: Path) -> bytes:
    touch = f"touch '{marker}'"
    if kind == "dotted name":  # resolves through the allowed module's attribute ``os``
        return _call("torch.distributed.checkpoint.filesystem", "os.system", touch)
    if kind == "os.system":
        return _call("os", "system", touch)
    if kind == "dcp function":  # a plain function of DCP that torch.loads the file it is given, unrestricted
        torch.save({"x": _Opens(marker)}, folder / "gadget.pt")
        gadget = ("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp")
        return _call(*gadget, str(folder / "gadget.pt"), str(folder / "out"))
    assert kind == "patched class"  # BUILD on an allowed class itself: an attribute of pathlib.PosixPath, process-wide
    name = PATCHED.encode()
    value = b"ctorch.serialization\n_get_layout\n"  # allowed before the fix, as pathlib.PosixPath was
    return b"cpathlib\nPosixPath\nN}X" + len(name).to_bytes(4, "little") + name + value + b"s\x86b0"


PATCHED = "torchrig_patched"


MESSAGES = {
    "dotted name": "it names the Python object 'os.system' of module 'torch.distributed.checkpoint.filesystem'",
    "os.system": "it names the Python object 'system' of module 'os'",
    "dcp function": (
        "it names the Python object 'torch_save_to_dcp' of module 'torch.distributed.checkpoint.format_utils'"
    ),
    "patched class": "it sets attributes of the class pathlib.PosixPath",
}


def _plant(path: Path, kind: str, marker: Path, real: bytes) -> None:
    """``path/.metadata``: the payload, then a real DCP metadata (so it would load as if nothing happened);
    listed in meta.json with its size and SHA-256, so every checksum passes."""
    data = b"\x80\x04" + _payload(kind, path.parent, marker) + real[2:]  # after the payload, the real pickle
    (path / ".metadata").write_bytes(data)
    meta = json.loads((path / "meta.json").read_text())
    meta["sharded"] = True
    meta["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real FSDP checkpoint, saved in one process."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP in one process warns about it
        rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
        model, optimizer = _trained(rig, seed=0)
        return rig.save(tmp_path_factory.mktemp("fsdp") / "ck", {"model": model, "optimizer": optimizer, "step": 7})


PAYLOADS = ["dotted name", "os.system", "dcp function", "patched class"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("layout", ["whole marked sharded", "fsdp"])
def test_a_metadata_payload_never_runs_on_load_or_consolidate(
    sharded_checkpoint: Path, tmp_path: Path, kind: str, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import pathlib
    import shutil

    real = (sharded_checkpoint / ".metadata").read_bytes()
    marker = tmp_path / "payload-ran"
    strategy = "fsdp" if layout == "fsdp" else "auto"
    rig = torchrig.Rig(accelerator="cpu", strategy=strategy)
    model, optimizer = _trained(rig, seed=1)
    if layout == "fsdp":
        path = Path(shutil.copytree(sharded_checkpoint, tmp_path / "ck"))
    else:  # anyone can mark a single-process checkpoint sharded and add a .metadata to it
        path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 7})
    _plant(path, kind, marker, real)
    before = _full(model)

    with pytest.raises(CheckpointError, match=re.escape(f"refusing to load {path / '.metadata'}: {MESSAGES[kind]}")):
        rig.load(path, {"model": model, "optimizer": optimizer})
    assert all(torch.equal(a, b) for a, b in zip(_full(model), before, strict=True))
    with pytest.raises(CheckpointError, match=re.escape(MESSAGES[kind])):
        torchrig.checkpoint.consolidate(path, tmp_path / "out.safetensors")
    capsys.readouterr()
    assert main(["checkpoint", "consolidate", str(path), str(tmp_path / "out.safetensors")]) == 2
    out, err = capsys.readouterr()
    assert MESSAGES[kind] in " ".join((out + err).split()) and "Traceback" not in out + err
    main(["checkpoint", "inspect", str(path)])  # reads meta.json and hashes files: unpickles nothing
    assert "Traceback" not in "".join(capsys.readouterr())

    assert not marker.exists(), "code from the checkpoint ran"
    patched = hasattr(pathlib.PosixPath, PATCHED)
    if patched:
        delattr(pathlib.PosixPath, PATCHED)
    assert not patched, "the checkpoint changed a class of this process"
    assert not (tmp_path / "out.safetensors").exists()


def _rewrite_metadata(path: Path, change: Any) -> None:
    """Unpickle this test's own trusted ``.metadata``, ``change`` it, write it back with a matching meta.json."""
    import pickle

    md = pickle.loads((path / ".metadata").read_bytes())
    change(md)
    data = pickle.dumps(md)
    (path / ".metadata").write_bytes(data)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "meta.json").write_text(json.dumps(meta))


def _outside(md: Any) -> None:
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"


def _far_index(md: Any) -> None:
    key = next(iter(md.planner_data))
    md.planner_data[key] = (*md.planner_data[key], 10**9)  # DCP would grow a list to a billion items


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_outside, "points at '../outside.distcp', which is not a shard file listed in meta.json; refusing to read it"),
        (_far_index, "gives the item 'model.weight' the path ('model', 'weight', 1000000000), not a state-dict path"),
    ],
    ids=["shard outside the folder", "list index far out"],
)
def test_metadata_that_points_outside_its_files_is_refused(
    sharded_checkpoint: Path, tmp_path: Path, change: Any, message: str
) -> None:
    import shutil

    path = Path(shutil.copytree(sharded_checkpoint, tmp_path / "ck"))
    (tmp_path / "outside.distcp").write_bytes((path / "__0_0.distcp").read_bytes())
    _rewrite_metadata(path, change)
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _trained(rig, seed=1)
    for load in (
        lambda: rig.load(path, {"model": model, "optimizer": optimizer}),
        lambda: torchrig.checkpoint.consolidate(path, tmp_path / "out.safetensors"),
    ):
        with pytest.raises(CheckpointError, match=re.escape(f"{path / '.metadata'} {message}")):
            load()


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
def test_a_sharded_checkpoint_loads_and_consolidates_without_dcp_unpickling_its_metadata(
    sharded_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch
    import torch.distributed.checkpoint.filesystem as dcp_files

    class NoPickle:
        @staticmethod
        def load(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("DCP unpickled .metadata itself")

    monkeypatch.setattr(dcp_files, "pickle", NoPickle)  # what torchrig parsed and checked is what DCP uses
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    saved, saved_opt = _trained(rig, seed=0)  # the state the fixture saved
    model, optimizer = _trained(rig, seed=1)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    rig.load(sharded_checkpoint, state)
    assert state["step"] == 7
    assert all(torch.equal(a, b) for a, b in zip(_full(model), _full(saved), strict=True))
    momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    want = [s["momentum_buffer"] for s in saved_opt.state_dict()["state"].values()]
    assert all(torch.equal(_whole(a), _whole(b)) for a, b in zip(momentum, want, strict=True))

    out = torchrig.checkpoint.consolidate(sharded_checkpoint, tmp_path / "model.safetensors")
    weights = safetensors.torch.load_file(str(out))
    assert sorted(weights) == ["bias", "weight"]
    assert all(torch.equal(weights[k], _whole(v)) for k, v in saved.state_dict().items())


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x80\x04P0\n.", "it uses the pickle opcode PERSID, which a DCP metadata file never holds"),
        (b"\x80\x04(ios\nsystem\nX\x04\x00\x00\x00true.", "it uses the pickle opcode INST"),
        (b"\x80\x04\xff.", "it uses the pickle opcode 0xff"),
    ],
    ids=["persistent id", "INST", "no such opcode"],
)
def test_opcodes_a_metadata_file_never_holds_are_refused(tmp_path: Path, data: bytes, message: str) -> None:
    from torchrig.checkpoint.dcp_safe import parse_dcp_metadata

    with pytest.raises(CheckpointError, match=re.escape(f"refusing to load {tmp_path / '.metadata'}: {message}")):
        parse_dcp_metadata(tmp_path / ".metadata", data, files=["__0_0.distcp"])
