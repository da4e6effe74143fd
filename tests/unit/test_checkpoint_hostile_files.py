"""Checkpoints that fight back: files that hang or never end, a malformed ``meta.json``, loads
refused half way, saves of state that cannot be saved, a full disk (issue 14, sections 3, 4, 6)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError, files, reading
from torchrig.cli import main

EMPTY_SHA = hashlib.sha256().hexdigest()


@pytest.fixture
def rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


@pytest.fixture
def saved(rig: torchrig.Rig, tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = rig.prepare(nn.Linear(4, 3))
    optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 7})


def _edit_meta(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _inspect_fails(path: Path, capsys: pytest.CaptureFixture[str], message: str) -> None:
    """``torchrig checkpoint inspect`` says what is wrong in one line and exits with 2 (it cannot
    read the checkpoint: not the 1 of a listed file that fails its check), without a traceback."""
    capsys.readouterr()
    code = main(["checkpoint", "inspect", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("torchrig checkpoint inspect: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    assert message in " ".join((out + err).split()), out + err


# -- section 3: only regular files inside the folder, read up to their listed size ---------------
@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
def test_a_fifo_listed_with_size_zero_is_refused_without_hanging(
    rig: torchrig.Rig, saved: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (saved / name).unlink()
    os.mkfifo(saved / name)  # opening it for reading would wait for a writer forever
    _edit_meta(saved, lambda m: m["files"].update({name: {"size": 0, "sha256": EMPTY_SHA}}))
    with pytest.raises(CheckpointError, match=rf"{name} is a named pipe \(FIFO\), not a regular file"):
        rig.load(saved, {"model": rig.prepare(nn.Linear(4, 3))})
    with pytest.raises(CheckpointError, match=r"is a named pipe \(FIFO\)"):
        torchrig.checkpoint.load(rig, saved, {"model": rig.prepare(nn.Linear(4, 3))}, verify=False)
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(saved)]) == 1  # the pipe is a failed file, listed as such
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.timeout(20)
def test_a_meta_json_that_is_a_fifo_or_a_link_is_refused(
    rig: torchrig.Rig, saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = (saved / "meta.json").read_bytes()
    (saved / "meta.json").unlink()
    os.mkfifo(saved / "meta.json")
    with pytest.raises(CheckpointError, match=r"meta\.json is a named pipe \(FIFO\), not a regular file"):
        rig.load(saved)
    _inspect_fails(saved, capsys, "meta.json is a named pipe (FIFO), not a regular file")
    (saved / "meta.json").unlink()
    (tmp_path / "elsewhere.json").write_bytes(real)
    (saved / "meta.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match=r"meta\.json is a symbolic link, not a regular file"):
        rig.load(saved)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("target", ["/dev/zero", "copy"])
def test_a_symlink_is_refused_even_to_the_right_bytes(
    rig: torchrig.Rig, saved: Path, tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    real = saved / "model.safetensors"
    if target == "copy":  # the very bytes meta.json lists, but outside the folder
        (tmp_path / "outside.safetensors").write_bytes(real.read_bytes())
        target = str(tmp_path / "outside.safetensors")
    real.unlink()
    real.symlink_to(target)  # /dev/zero: reading it would never end
    model = rig.prepare(nn.Linear(4, 3))
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a symbolic link, not a regular file"):
        rig.load(saved, {"model": model})
    assert torch.equal(model.weight, before)
    _edit_meta(saved, lambda m: m["files"]["model.safetensors"].update(size=0))  # /dev/zero's stat size
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a symbolic link"):
        rig.load(saved, {"model": model})
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a symbolic link"):
        torchrig.checkpoint.consolidate(saved, tmp_path / "out.safetensors")


def test_reads_stop_at_the_listed_size(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    assert reading.read_regular(tmp_path / "f", 10) == b"0123456789"
    with pytest.raises(CheckpointError, match=r"f is 10 bytes but meta\.json says 4"):
        reading.read_regular(tmp_path / "f", 4)
    with pytest.raises(CheckpointError, match=r"f is 10 bytes, more than the 8 a torchrig f can be"):
        reading.read_regular(tmp_path / "f", limit=8)
    assert reading.sha256_file(tmp_path / "f", 10) == hashlib.sha256(b"0123456789").hexdigest()
    with pytest.raises(CheckpointError, match=r"f is 10 bytes but meta\.json says 11"):
        reading.sha256_file(tmp_path / "f", 11)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", ".hidden", "a\\b", ".."])
def test_file_names_outside_the_folder_are_refused(
    rig: torchrig.Rig, saved: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def point_model_at(meta: dict[str, Any]) -> None:
        meta["files"][name] = meta["files"].pop("model.safetensors")
        meta["entries"]["model"].update(file=name, files=[name])

    _edit_meta(saved, point_model_at)
    message = f"files lists {name!r}, which is not a plain file name inside the checkpoint folder"
    with pytest.raises(CheckpointError, match=rf"meta\.json: {re.escape(message)}"):
        rig.load(saved, {"model": rig.prepare(nn.Linear(4, 3))})
    _inspect_fails(saved, capsys, message)


SCHEMA_CASES: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    ("files a list", lambda m: m.update(files=list(m["files"])),
     "files must be a JSON object of file names, got a JSON array"),
    ("no size", lambda m: m["files"]["state.pt"].pop("size"),
     "files['state.pt'].size must be a non-negative integer, got None"),
    ("size text", lambda m: m["files"]["model.safetensors"].update(size="x"),
     "files['model.safetensors'].size must be a non-negative integer, got 'x'"),
    ("size negative", lambda m: m["files"]["state.pt"].update(size=-1),
     "files['state.pt'].size must be a non-negative integer, got -1"),
    ("size bool", lambda m: m["files"]["state.pt"].update(size=True),
     "files['state.pt'].size must be a non-negative integer, got True"),
    ("sha text", lambda m: m["files"]["state.pt"].update(sha256="abc"),
     "files['state.pt'].sha256 must be 64 hex digits, got 'abc'"),
    ("version text", lambda m: m.update(version="two"),
     "version must be a non-negative integer, got 'two'"),
    ("entries list", lambda m: m.update(entries=[]),
     "entries must be a JSON object of state keys, got a JSON array"),
    ("entry list", lambda m: m["entries"].update(model=[]),
     "entries['model'] must be a JSON object with kind and type, got a JSON array"),
    ("kind", lambda m: m["entries"]["model"].update(kind="weights"),
     "entries['model'].kind must be one of module, state, value, optimizer, got 'weights'"),
    ("no type", lambda m: m["entries"]["step"].pop("type"),
     "entries['step'].type must be a string, got None"),
    ("unlisted", lambda m: m["entries"]["model"].update(files=["other.safetensors"]),
     "entries['model'].files must be names of files listed under files, got a JSON array"),
    ("key", lambda m: m["entries"].update({"../x": {"kind": "value",
     "type": "int"}}), "entries['../x'] is not a plain state key"),
    ("values", lambda m: m.update(values=3),
     "values must be a JSON object, got 3"),
    ("parameters", lambda m: m.update(parameters="many"),
     "parameters must be a non-negative integer, got 'many'"),
    ("buffers", lambda m: m.update(buffers=-1),
     "buffers must be a non-negative integer, got -1"),
    ("sharded", lambda m: m.update(sharded="yes"),
     "sharded must be true or false, got 'yes'"),
]  # fmt: skip


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("change", "message"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES])
def test_a_malformed_meta_json_is_a_checkpoint_error_naming_the_field(
    rig: torchrig.Rig,
    saved: Path,
    change: Callable[[dict[str, Any]], object],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _edit_meta(saved, change)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(saved / 'meta.json'))}: {re.escape(message)}"):
        rig.load(saved, {"model": rig.prepare(nn.Linear(4, 3))})
    with pytest.raises(CheckpointError, match=re.escape(message)):
        torchrig.checkpoint.describe(saved)
    _inspect_fails(saved, capsys, message)


@pytest.mark.timeout(20)
def test_deeply_nested_or_broken_json_is_a_checkpoint_error(
    rig: torchrig.Rig, saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (saved / "meta.json").read_text()
    (saved / "meta.json").write_text(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=r"meta\.json is not valid JSON \(it nests too deeply\)"):
        rig.load(saved)
    _inspect_fails(saved, capsys, "is not valid JSON (it nests too deeply)")
    (saved / "meta.json").write_text(text[:-5])
    with pytest.raises(CheckpointError, match=r"meta\.json is not valid JSON"):
        rig.load(saved)


def test_ctrl_c_during_a_load_does_not_wait_for_blocked_reads(saved: Path) -> None:
    """A KeyboardInterrupt leaves the reader at once; a read still under way finishes on its own."""
    meta = reading.read_meta(saved)
    release = threading.Event()
    with pytest.raises(KeyboardInterrupt), reading.VerifiedReader(saved, meta) as reader:
        blocked = reader.submit("state.pt", lambda path, hashing: (release.wait(), None))
        raise KeyboardInterrupt
    assert not blocked.done()  # before the fix, leaving the block waited here for ever
    release.set()
    assert blocked.result(timeout=10) is True


# -- section 6: the weights_only refusal, plainly -------------------------------------------------
class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


@pytest.mark.timeout(20)
def test_the_pickle_refusal_names_the_globals_in_plain_whole_text(rig: torchrig.Rig, saved: Path) -> None:
    marker = saved.parent / "payload-ran"
    buf = io.BytesIO()
    torch.save({"objects": {}, "values": {"step": Payload(marker)}, "module_extras": {}, "rng": []}, buf)
    (saved / "state.pt").write_bytes(buf.getvalue())
    _edit_meta(
        saved,
        lambda m: m["files"]["state.pt"].update(
            size=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest()
        ),
    )
    with pytest.raises(CheckpointError) as caught:
        rig.load(saved)
    text = str(caught.value)
    assert text == (  # the name pickle records: io.open on Python 3.11, _io.open on 3.12
        f"refusing to load {saved / 'state.pt'}: it holds Python objects other than tensors and plain "
        f"containers ({open.__module__}.open), which could run code when unpickled; torchrig only loads tensors, "
        "numbers, strings, lists, tuples and dicts, and nothing in the file was run"
    )
    assert "\x1b" not in text and not marker.exists()


# -- section 4: a refused load changes nothing ----------------------------------------------------
class HalfWay:
    """An object whose load_state_dict changes itself, then fails (as torch's can, through hooks)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        if sd.get("fail", True) and sd["n"] == 5:
            raise RuntimeError("failed half way")


def _trained(
    rig: torchrig.Rig, seed: int, opt: str = "sgd", groups: int = 1, shape: tuple[int, int] = (4, 3)
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = rig.prepare(nn.Linear(*shape))
    params = [model.weight, model.bias]
    param_groups = [{"params": params}] if groups == 1 else [{"params": params[:1]}, {"params": params[1:]}]
    made = torch.optim.SGD(param_groups, lr=0.1, momentum=0.9) if opt == "sgd" else torch.optim.AdamW(param_groups)
    optimizer = rig.prepare(made)
    model(torch.randn(2, shape[0])).sum().backward()
    optimizer.step()
    return model, optimizer


def _fingerprint(*objs: Any) -> list[Any]:
    """Every tensor (cloned) and every other value the objects hold, to compare bitwise."""
    out: list[Any] = [torch.get_rng_state()]
    for obj in objs:
        if isinstance(obj, nn.Module):
            out += [t.detach().clone() for t in obj.state_dict().values()]
        elif isinstance(obj, torch.optim.Optimizer):
            sd = obj.state_dict()
            out.append(repr(sd["param_groups"]))
            for i, s in sd["state"].items():
                out += [(i, k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()]
        else:
            out.append(repr(obj.state_dict()))
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, tuple):
            return isinstance(y, tuple) and len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y, strict=True))
        return bool(x == y)

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))


REFUSALS = {
    "adamw for sgd": ({"opt": "adamw"}, {}, r"entry 'optimizer' does not match the AdamW given: it was saved from a "
                      r"torch\.optim\.sgd\.SGD, not a torch\.optim\.adamw\.AdamW"),
    "param groups": ({"groups": 2}, {}, r"does not match the SGD given: 1 parameter groups in the checkpoint, 2 in"),
    "state shapes": ({"shape": (3, 4)}, {"strict": False},
                     r"does not match the SGD given:\n  state 'momentum_buffer' of parameter 0: checkpoint "
                     r"\(3, 4\), optimizer \(4, 3\)\n  state 'momentum_buffer' of parameter 1: checkpoint \(3,\), "
                     r"optimizer \(4,\)"),
    "module shapes": ({"shape": (3, 4)}, {}, r"entry 'model' does not match the module Linear:\n  shape mismatch"),
    "half way": ({}, {"half_way": True}, r"could not load checkpoint entry 'extra' \(saved from a "
                 r"test_checkpoint_hostile_files\.HalfWay\) into the HalfWay given: failed half way; "
                 r"nothing was changed"),
    "scheduler class": ({}, {"scheduler": True}, r"entry 'schedule' was saved from a "
                        r"torch\.optim\.lr_scheduler\.StepLR, not the torch\.optim\.lr_scheduler\.ExponentialLR given"),
    "no state_dict": ({}, {"value_as_object": True}, r"entry 'step' holds a builtins\.int, which has no state_dict"),
}  # fmt: skip


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_refused_load_leaves_every_object_bitwise_as_it_was(rig: torchrig.Rig, tmp_path: Path, kind: str) -> None:
    build, how, message = REFUSALS[kind]
    model, optimizer = _trained(rig, seed=0)
    extra = HalfWay()
    extra.n = 5  # loading 5 back fails after setting it
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "extra": extra, "schedule": schedule,
                                      "step": 7})  # fmt: skip

    model2, optimizer2 = _trained(rig, seed=1, **build)  # type: ignore[arg-type]
    state: dict[str, Any] = {"model": model2, "optimizer": optimizer2}
    if how.get("half_way"):
        state["extra"] = HalfWay()
    if how.get("scheduler"):
        state["schedule"] = torch.optim.lr_scheduler.ExponentialLR(optimizer2, gamma=0.5)
    if how.get("value_as_object"):
        state["step"] = HalfWay()
    objs = list(state.values())
    before = _fingerprint(*objs)
    with pytest.raises(CheckpointError, match=message):
        rig.load(path, state, strict=how.get("strict", True))
    assert _same(_fingerprint(*objs), before), "a refused load changed an object"
    assert state["model"] is model2 and state["optimizer"] is optimizer2

    # The same objects, matching, do load (the refusal was the mismatch, not the objects).
    if kind == "half way":
        ok = {"model": model2, "optimizer": optimizer2, "schedule": torch.optim.lr_scheduler.StepLR(optimizer2, 2)}
        rig.load(path, ok)
        assert _same(_fingerprint(model2), _fingerprint(model))


# -- section 6: a full disk, state that cannot be saved ------------------------------------------
NO_SPACE = r"no space left on device at {}: the checkpoint needs about \d+\.\d MB, \d+\.\d MB free; nothing was "


def _assert_previous_survives(rig: torchrig.Rig, folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["last", "step-1"]  # no temp dir, no step-2
    assert rig.load(folder / "last")["step"] == 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["torch.save", "safetensors"])
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import errno

    import safetensors
    import safetensors.torch

    model = rig.prepare(nn.Linear(64, 64))
    rig.save(tmp_path / "step-1", {"model": model, "step": 1})
    if where == "torch.save":  # torch reports it as "unexpected pos", the OSError as its context

        def full(self: Any, b: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(files.HashingWriter, "write", full)
    else:  # safetensors' Rust writer puts the errno in its text

        def full_st(*args: Any, **kwargs: Any) -> None:
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(safetensors.torch, "save_file", full_st)
    with pytest.raises(CheckpointError, match=NO_SPACE.format(re.escape(str(tmp_path / "step-2")))):
        rig.save(tmp_path / "step-2", {"model": model, "step": 2})
    monkeypatch.undo()
    _assert_previous_survives(rig, tmp_path)


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
def test_a_full_disk_in_a_sharded_save_says_so_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP wraps each rank's error in its own CheckpointException: the full disk is found inside."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model = rig.prepare(nn.Linear(64, 64))
    rig.save(tmp_path / "step-1", {"model": model, "step": 1})

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointError, match=NO_SPACE.format(re.escape(str(tmp_path / "step-2")))):
        rig.save(tmp_path / "step-2", {"model": model, "step": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-1"]  # no temp dir, no step-2
    assert rig.load(tmp_path / "last", {"model": model})["step"] == 1


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs (needs root and mount(2)); skipped where it cannot be made."""
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.timeout(30)
def test_a_really_full_disk_says_so_and_keeps_the_previous_checkpoint(rig: torchrig.Rig, small_disk: Path) -> None:
    model = rig.prepare(nn.Linear(64, 64))
    rig.save(small_disk / "step-1", {"model": model, "step": 1})
    big = rig.prepare(nn.Linear(1024, 512))  # 2 MB of weights: more than the whole disk
    with pytest.raises(CheckpointError, match=NO_SPACE.format(re.escape(str(small_disk / "step-2")))) as caught:
        rig.save(small_disk / "step-2", {"model": big, "step": 2})
    assert re.search(r"needs about 2\.\d MB", str(caught.value))
    _assert_previous_survives(rig, small_disk)


class _Holder:
    """An object whose state_dict holds something that cannot be saved."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["inner"]


def _nested(depth: int) -> list[Any]:
    x: list[Any] = []
    for _ in range(depth):
        x = [x]
    return x


def _self_referencing() -> list[Any]:
    a: list[Any] = [1, 2]
    a.append({"back": a})
    return a


UNSAVEABLE = {
    "huge int": (lambda: 2**70_000, r"state\['x'\] cannot be saved in a checkpoint: weights_only loading cannot read "
                 r"an int of more than 255 bytes \(pickle opcode LONG4\) back"),
    "self reference": (_self_referencing, r"state\['x'\]\[2\]\['back'\] is a list that contains itself; a checkpoint "
                       r"cannot hold a list or dict that refers to itself"),
    "lambda": (lambda: {"f": lambda: 1}, r"state\['x'\] cannot be saved in a checkpoint: pickle cannot store it "
               r"\(Can't pickle .*\); functions and local classes cannot be saved"),
    "in a state_dict": (lambda: _Holder(lambda: 1), r"state\['x'\]\.state_dict\(\) cannot be saved in a checkpoint: "
                        r"pickle cannot store it"),
    "deep": (lambda: _nested(5000), r"state\['x'\] cannot be saved in a checkpoint: it nests "
             r"too deeply for pickle"),
}  # fmt: skip


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", list(UNSAVEABLE))
def test_state_that_cannot_be_saved_is_a_type_error_naming_the_key(
    rig: torchrig.Rig, tmp_path: Path, kind: str
) -> None:
    make, message = UNSAVEABLE[kind]
    with pytest.raises(TypeError, match=message) as caught:
        rig.save(tmp_path / "ck", {"step": 1, "x": make()})
    assert caught.value.__cause__ is None and "\x1b" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # checked before anything is written


@pytest.mark.timeout(20)
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's own quantized-tensor rebuild warns (TypedStorage)
def test_a_quantized_tensor_is_saved_and_loaded(rig: torchrig.Rig, tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), 0.5, 0, torch.qint8)
    rig.save(tmp_path / "ck", {"q": q})
    back = rig.load(tmp_path / "ck")["q"]
    assert back.is_quantized and torch.equal(back.int_repr(), q.int_repr()) and back.q_scale() == 0.5


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["adamw for sgd", "scheduler class", "no state_dict"])
def test_a_refused_sharded_load_leaves_every_object_as_it_was(tmp_path: Path, kind: str) -> None:
    """Under FSDP, DCP writes into the modules as it reads: everything is checked before it starts."""
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _trained(rig, seed=0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 7})
    model2, optimizer2 = _trained(rig, seed=1, opt="adamw" if kind == "adamw for sgd" else "sgd")
    state: dict[str, Any] = {"model": model2, "optimizer": optimizer2}
    if kind == "scheduler class":
        state["schedule"] = torch.optim.lr_scheduler.ExponentialLR(optimizer2, gamma=0.5)
    if kind == "no state_dict":
        state["step"] = HalfWay()
    message = {
        "adamw for sgd": r"entry 'optimizer' was saved from a torch\.optim\.sgd\.SGD, not the torch\.optim\.adamw",
        "scheduler class": r"entry 'schedule' was saved from a torch\.optim\.lr_scheduler\.StepLR",
        "no state_dict": r"entry 'step' holds a builtins\.int, which has no state_dict",
    }[kind]
    before = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in _fingerprint(model2)]
    with pytest.raises(CheckpointError, match=message):
        rig.load(path, state)
    after = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in _fingerprint(model2)]
    assert _same(after, before), "a refused sharded load changed the model"


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
def test_a_sharded_checkpoint_reads_no_fifo_and_lists_its_dcp_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model, optimizer = _trained(rig, seed=0)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 7})
    (path / ".metadata").unlink()
    os.mkfifo(path / ".metadata")  # DCP and the metadata check would wait on it for ever
    _edit_meta(path, lambda m: m["files"].update({".metadata": {"size": 0, "sha256": EMPTY_SHA}}))
    with pytest.raises(CheckpointError, match=r"\.metadata is a named pipe \(FIFO\), not a regular file"):
        rig.load(path, {"model": model, "optimizer": optimizer})
    with pytest.raises(CheckpointError, match=r"\.metadata is a named pipe \(FIFO\)"):
        torchrig.checkpoint.consolidate(path, tmp_path / "out.safetensors")
    _edit_meta(path, lambda m: m["files"].pop(".metadata"))  # unlisted, it would escape the checks
    message = "files must list .metadata in a sharded checkpoint"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        rig.load(path, {"model": model, "optimizer": optimizer})
    _inspect_fails(path, capsys, message)


def test_a_file_given_as_a_checkpoint_says_what_it_is_and_how_to_read_it(
    rig: torchrig.Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's first load is often of a file another tool wrote; nothing in it is unpickled."""
    import safetensors.torch

    from conftest import ROOT

    model = nn.Linear(4, 3)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    safetensors.torch.save_file(model.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "random.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "empty").write_bytes(b"")
    lightning = ROOT / "tests" / "data" / "peers" / "lightning.ckpt"  # written by Lightning 2.6's Trainer
    tail = "but a torchrig checkpoint is a directory holding meta.json"
    expected = {
        tmp_path / "model.pt": f"a file torch.save wrote, {tail}; read it with torch.load('{tmp_path / 'model.pt'}', "
        "weights_only=True)",
        tmp_path / "model.safetensors": f"a safetensors file, {tail}; read it with "
        f"safetensors.torch.load_file('{tmp_path / 'model.safetensors'}')",
        lightning: f"a Lightning checkpoint, {tail}; convert it once with `torchrig checkpoint import {lightning} OUT`",
        tmp_path / "random.bin": f"a file, {tail}",
        tmp_path / "empty": f"a file, {tail}",
    }
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for path, what in expected.items():
        before = path.read_bytes()
        with pytest.raises(CheckpointError) as refused:
            rig.load(path, {"model": model})
        assert str(refused.value) == f"{path} is {what}"
        assert main(["checkpoint", "inspect", str(path)]) == 2
        assert capsys.readouterr().err == f"torchrig checkpoint inspect: {path} is {what}\n"
        assert path.read_bytes() == before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


class _Tiny(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise AssertionError("a wrong ckpt_path is refused before the first step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("path", [5, None, b"ck"], ids=["int", "None", "bytes"])
def test_a_path_of_the_wrong_type_is_named(rig: torchrig.Rig, path: Any, tmp_path: Path) -> None:
    """It was os.fspath's 'expected str, bytes or os.PathLike object, not int', naming no argument."""
    import contextlib

    kind = type(path).__name__
    with contextlib.chdir(tmp_path):
        with pytest.raises(
            TypeError, match=rf"^path={re.escape(repr(path))} must be a path \(str or os.PathLike\), not {kind}$"
        ):
            rig.save(path, {"step": 1})
        with pytest.raises(
            TypeError, match=rf"^path={re.escape(repr(path))} must be a path \(str or os.PathLike\), not {kind}$"
        ):
            rig.load(path, {"step": 1})
        trainer = torchrig.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_epochs=1)
        if path is not None:  # None: no checkpoint
            with pytest.raises(TypeError, match=rf"^ckpt_path={re.escape(repr(path))} must be a path"):
                data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 4)))
                trainer.fit(_Tiny(), data, ckpt_path=path)
    assert list(tmp_path.iterdir()) == []


def test_a_save_below_a_file_or_at_dotdot_names_what_is_there(rig: torchrig.Rig, tmp_path: Path) -> None:
    """'afile/ck' raised a bare NotADirectoryError; 'work/..' said it was the root of the file system."""
    import contextlib

    work = tmp_path / "work"
    work.mkdir()
    (work / "afile").write_text("the user's")
    (work / "notes.txt").write_text("the user's")
    before = {p: p.read_bytes() for p in work.rglob("*")}
    model = rig.prepare(nn.Linear(2, 2))
    with contextlib.chdir(work):
        for path in ("afile/ck", "afile/deeper/ck"):
            with pytest.raises(CheckpointError) as refused:
                rig.save(path, {"model": model})
            assert str(refused.value) == (
                f"cannot save a checkpoint at {work / path}: {work / 'afile'} is a regular file, not a directory; "
                "give a path inside a directory"
            )
        with pytest.raises(
            CheckpointError,
            match=rf"^cannot save a checkpoint at {re.escape(str(work))}/\.\.: it is the "
            rf"directory {re.escape(str(tmp_path))}; only a missing path or a torchrig checkpoint",
        ):
            rig.save("..", {"model": model})
    assert {p: p.read_bytes() for p in work.rglob("*")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
