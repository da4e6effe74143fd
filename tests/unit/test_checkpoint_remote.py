"""Checkpoints on object storage through fsspec, on its in-memory file system (fast, everywhere):
the commit rule (files under a prefix of their own, meta.json last, ``last`` a pointer object),
a death at every step of an upload, tampering, retention, background saves and the CLI.

Sharded (FSDP) checkpoints: test_checkpoint_remote_sharded.py. The same rules against a real S3
server (moto) and the real s3fs client: test_checkpoint_s3.py.
"""

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
from conftest import trained_mlp
from torchrig.checkpoint import CheckpointError, CheckpointURL

fsspec = pytest.importorskip("fsspec")
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402


def _fs() -> Any:
    return fsspec.filesystem("memory")


def _rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


def _versions(url: str) -> list[str]:
    return sorted(_fs().ls(url.removeprefix("memory://"), detail=False))


def test_save_and_load_round_trip_exactly_through_a_last_object(memory_url: str) -> None:
    rig = _rig()
    model, opt = trained_mlp(0)
    saved = rig.save(f"{memory_url}/step-1", {"model": model, "optimizer": opt, "step": 1})
    assert isinstance(saved, CheckpointURL) and saved == f"{memory_url}/step-1" and saved.name == "step-1"

    # Layout: the files under one version prefix, meta.json among them; ``last`` names the checkpoint.
    (version,) = _versions(f"{memory_url}/step-1")
    assert version.rsplit("/", 1)[-1].startswith("v-")
    files = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(version, detail=False))
    meta = json.loads(_fs().cat_file(f"{version}/meta.json"))
    assert files == sorted([*meta["files"], "meta.json"])
    assert json.loads(_fs().cat_file(f"{memory_url.removeprefix('memory://')}/last")) == {"checkpoint": "step-1"}

    other, other_opt = trained_mlp(1)
    left = rig.load(f"{memory_url}/last", {"model": other, "optimizer": other_opt})
    assert left["step"] == 1
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for s, t in zip(opt.state.values(), other_opt.state.values(), strict=True):
        assert all(torch.equal(s[k], t[k]) for k in s)


def test_file_urls_take_the_local_path(tmp_path: Path) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    saved = rig.save(f"file://{tmp_path}/ck", {"model": model, "step": 4})
    assert saved == tmp_path / "ck" and (tmp_path / "ck" / "meta.json").is_file()
    assert (tmp_path / "last").is_symlink()
    assert rig.load(f"file://{tmp_path}/last")["step"] == 4


def test_replacing_a_checkpoint_keeps_one_committed_version(memory_url: str) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    first = _versions(f"{memory_url}/ck")
    rig.save(f"{memory_url}/ck", {"model": model, "step": 2})
    second = _versions(f"{memory_url}/ck")
    assert len(second) == 1 and second != first
    assert rig.load(f"{memory_url}/ck")["step"] == 2
    assert rig.load(f"{memory_url}/last")["step"] == 2


class _Died(BaseException):
    """The process is gone: nothing after this runs (not even clean-up)."""


WHOLE_CHANGES = ("put_file", "pipe_file", "rm_file", "rmdir")


def _die_at(monkeypatch: pytest.MonkeyPatch, k: int, seen: list[str], changes: tuple[str, ...] = WHOLE_CHANGES) -> None:
    """From the k-th change on, every change of the in-memory store fails: the saving process died
    there. ``changes`` names the methods that change it (``_open`` counts only when writing)."""

    def wrap(name: str) -> None:
        real = getattr(MemoryFileSystem, name)

        def op(self: Any, *a: Any, **kw: Any) -> Any:
            if name == "_open" and "w" not in (a[1] if len(a) > 1 else kw.get("mode", "rb")):
                return real(self, *a, **kw)
            seen.append(f"{name} {a[-1] if name in ('put_file', 'cp_file') else a[0]}")
            if len(seen) >= k:
                raise _Died(name)
            return real(self, *a, **kw)

        monkeypatch.setattr(MemoryFileSystem, name, op)

    for name in changes:
        wrap(name)


def test_a_death_at_every_upload_step_leaves_last_loadable(memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    steps: list[str] = []
    for k in range(1, 100):
        base = f"{memory_url}/k{k}"
        rig.save(f"{base}/ck", {"model": model, "step": 1})
        rig.save(f"{base}/old", {"model": model, "step": 0}, link=None)  # falls to keep_last=2
        seen: list[str] = []
        with monkeypatch.context() as m:
            _die_at(m, k, seen)
            try:
                rig.save(f"{base}/ck", {"model": model, "step": 2}, keep_last=2)
                finished = True
            except _Died:
                finished = False
        step = rig.load(f"{base}/last")["step"]
        # Old or new, never nothing; the new one only once its meta.json is there.
        meta_written = any(s.startswith("put_file") and s.endswith("/meta.json") for s in seen[: k - 1])
        assert step == (2 if meta_written or finished else 1), (k, seen)
        # The next save tidies what the dead one left under the name.
        rig.save(f"{base}/ck", {"model": model, "step": 3})
        assert len(_versions(f"{base}/ck")) == 1 and rig.load(f"{base}/last")["step"] == 3
        if finished:
            steps = seen
            break
    # The kill points covered every change of the save: each file, meta.json, last, the old version, retention.
    assert k == len(steps) + 1
    kinds = [s.split()[0] for s in steps]
    assert kinds.count("pipe_file") == 1 and "rm_file" in kinds
    assert [s for s in steps if s.startswith("put_file")][-1].endswith("/meta.json")
    assert steps.index(next(s for s in steps if s.startswith("pipe_file"))) > kinds.index("put_file") + 2


def test_a_tampered_object_is_refused_and_nothing_changes(memory_url: str) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    (version,) = _versions(f"{memory_url}/ck")
    data = bytearray(_fs().cat_file(f"{version}/model.safetensors"))
    data[-1] ^= 0xFF
    _fs().pipe_file(f"{version}/model.safetensors", bytes(data))
    other, _ = trained_mlp(1)
    before = [t.clone() for t in other.state_dict().values()]
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*model\.safetensors: SHA-256 is"):
        rig.load(f"{memory_url}/last", {"model": other})
    assert all(torch.equal(a, b) for a, b in zip(before, other.state_dict().values(), strict=True))


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
def test_a_download_is_hashed_as_it_arrives_and_that_digest_refuses_a_tampered_object(
    memory_url: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reader never reads a downloaded file back to hash it: the digest taken while the bytes
    # arrived is compared with meta.json, and it alone refuses the tampered object before anything
    # is parsed or filled. A local load of the same files still hashes them (the spy sees it).
    from torchrig.checkpoint import reading

    rig = _rig()
    model, opt = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "optimizer": opt, "step": 1})
    (version,) = _versions(f"{memory_url}/ck")
    rehashed: list[str] = []
    real = reading.sha256_file
    monkeypatch.setattr(reading, "sha256_file", lambda path, size=None: rehashed.append(path.name) or real(path, size))

    other, other_opt = trained_mlp(1)
    assert rig.load(f"{memory_url}/last", {"model": other, "optimizer": other_opt})["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    assert rehashed == []

    listed = json.loads(_fs().cat_file(f"{version}/meta.json"))["files"][name]["sha256"]
    data = bytearray(_fs().cat_file(f"{version}/{name}"))
    data[len(data) // 2] ^= 0xFF
    _fs().pipe_file(f"{version}/{name}", bytes(data))
    other, other_opt = trained_mlp(1)
    before = [t.clone() for t in other.state_dict().values()]
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(
        CheckpointError,
        match=rf"^checksum mismatch in memory://{version}/{re.escape(name)}: SHA-256 is {digest}, meta\.json says "
        rf"{listed}; the file was altered or corrupted, refusing to load it$",
    ):
        rig.load(f"{memory_url}/last", {"model": other, "optimizer": other_opt})
    assert all(torch.equal(a, b) for a, b in zip(before, other.state_dict().values(), strict=True))
    assert rehashed == []

    local = tmp_path / "ck"  # the same files on the local disk: the local path hashes them as before
    _fs().get(f"{version}/", f"{local}/", recursive=True)
    with pytest.raises(
        CheckpointError, match=rf"checksum mismatch in {re.escape(str(local / name))}: SHA-256 is {digest}"
    ):
        rig.load(local, {"model": other, "optimizer": other_opt})
    assert set(rehashed) == {"model.safetensors", "state.pt"}


def test_a_download_that_fails_is_raised_as_it_is_and_nothing_changes(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store that breaks off one transfer (not a missing object): its error reaches the caller,
    # the other transfers stop, and the objects are not touched.
    import contextlib

    from torchrig.checkpoint import remote

    rig = _rig()
    model, opt = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "optimizer": opt, "step": 1})
    real = remote._streamed

    @contextlib.contextmanager
    def breaking(fs: Any, path: str) -> Any:
        with real(fs, path) as read:
            if path.endswith("/model.safetensors"):

                def broken(n: int) -> bytes:
                    raise ConnectionResetError("the store closed the connection")

                yield broken
            else:
                yield read

    monkeypatch.setattr(remote, "_streamed", breaking)
    other, other_opt = trained_mlp(1)

    def everything() -> list[torch.Tensor]:
        return [*other.state_dict().values(), *(t for s in other_opt.state.values() for t in s.values())]

    before = [t.clone() for t in everything()]
    with pytest.raises(ConnectionResetError, match=r"^the store closed the connection$"):
        rig.load(f"{memory_url}/last", {"model": other, "optimizer": other_opt})
    assert all(torch.equal(a, b) for a, b in zip(before, everything(), strict=True))


def test_an_object_longer_than_meta_json_says_is_refused_with_its_size(memory_url: str) -> None:
    # The download reads one byte past the listed size, not the whole object, and names its real size.
    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    (version,) = _versions(f"{memory_url}/ck")
    size = json.loads(_fs().cat_file(f"{version}/meta.json"))["files"]["model.safetensors"]["size"]
    _fs().pipe_file(f"{version}/model.safetensors", _fs().cat_file(f"{version}/model.safetensors") + b"\0" * 10)
    with pytest.raises(
        CheckpointError,
        match=rf"^memory://{version}/model\.safetensors is {size + 10} bytes but meta\.json says {size}: the file "
        r"was truncated or altered \(checksum mismatch\); refusing to load it$",
    ):
        rig.load(f"{memory_url}/last", {"model": model})


def test_a_save_to_object_storage_does_not_fsync_its_staging_copy(
    memory_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The staged files only feed the upload (the store makes them durable) and are removed after
    # it: no fsync there. A local save still fsyncs every file it writes.
    from torchrig.checkpoint import files

    synced: list[str] = []
    real = files.durable
    monkeypatch.setattr(files, "durable", lambda path: synced.append(Path(path).name) or real(path))
    rig = _rig()
    model, opt = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "optimizer": opt, "step": 1})
    assert synced == []
    other, other_opt = trained_mlp(1)
    assert rig.load(f"{memory_url}/ck", {"model": other, "optimizer": other_opt})["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    rig.save(tmp_path / "ck", {"model": model, "optimizer": opt, "step": 1})
    assert sorted(synced) == ["model.safetensors", "state.pt"]


def test_a_staged_file_is_uploaded_while_the_others_are_still_written(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # state.pt's write waits until model.safetensors (written beside it) is up: a save that
    # uploaded only after every file was written would never get there.
    import threading

    from torchrig.checkpoint import core

    up = threading.Event()
    real_put, real_write = MemoryFileSystem.put_file, core.write_torch

    def put_file(self: Any, lpath: str, rpath: str, *a: Any, **kw: Any) -> Any:
        done = real_put(self, lpath, rpath, *a, **kw)
        if rpath.endswith("/model.safetensors"):
            up.set()
        return done

    def write_torch(path: Path, fsync: bool, obj: Any) -> str:
        if not up.wait(timeout=20):
            raise AssertionError("model.safetensors was not uploaded while state.pt was written")
        return real_write(path, fsync, obj)

    monkeypatch.setattr(MemoryFileSystem, "put_file", put_file)
    monkeypatch.setattr(core, "write_torch", write_torch)
    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    other, _ = trained_mlp(1)
    assert rig.load(f"{memory_url}/ck", {"model": other})["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


def test_a_save_whose_last_write_fails_removes_the_files_it_uploaded(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # model.safetensors is up before state.pt's write fails: nothing of that save stays under the
    # name, the error says nothing was committed, and the checkpoint there before is still loaded.
    import threading

    from torchrig.checkpoint import core

    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    (before,) = _versions(f"{memory_url}/ck")
    up = threading.Event()
    real_put = MemoryFileSystem.put_file

    def put_file(self: Any, lpath: str, rpath: str, *a: Any, **kw: Any) -> Any:
        done = real_put(self, lpath, rpath, *a, **kw)
        up.set()
        return done

    def write_torch(path: Path, fsync: bool, obj: Any) -> str:
        up.wait(timeout=20)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(MemoryFileSystem, "put_file", put_file)
    monkeypatch.setattr(core, "write_torch", write_torch)
    with pytest.raises(CheckpointError, match=r"^saving .*/ck failed before the checkpoint was committed \(OSError"):
        rig.save(f"{memory_url}/ck", {"model": model, "step": 2})
    assert up.is_set() and _versions(f"{memory_url}/ck") == [before]
    assert rig.load(f"{memory_url}/last")["step"] == 1


def test_an_upload_without_meta_json_is_never_read(memory_url: str) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 1})
    path = memory_url.removeprefix("memory://")
    _fs().pipe_file(f"{path}/ck/v-99999999999999999999-0badc0de/state.pt", b"half an upload")
    assert rig.load(f"{memory_url}/ck")["step"] == 1  # the newest *committed* version
    _fs().pipe_file(f"{path}/only/v-00000000000000000001-0badc0de/state.pt", b"half an upload")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint at .*/only: 1 upload\(s\) under it"):
        rig.load(f"{memory_url}/only")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at memory://.*/nothing"):
        rig.load(f"{memory_url}/nothing")


def test_a_hostile_last_object_is_refused(memory_url: str) -> None:
    rig = _rig()
    path = memory_url.removeprefix("memory://")
    _fs().pipe_file(f"{path}/last", json.dumps({"checkpoint": "../elsewhere"}).encode())
    with pytest.raises(CheckpointError, match=r"names '\.\./elsewhere', which is not a checkpoint name in its folder"):
        rig.load(f"{memory_url}/last")
    _fs().pipe_file(f"{path}/last", b"x" * 5000)
    with pytest.raises(CheckpointError, match=r"is over 4096 bytes: a torchrig link object holds one checkpoint name"):
        rig.load(f"{memory_url}/last")


def test_keep_last_removes_only_the_oldest_committed_checkpoints(memory_url: str) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    path = memory_url.removeprefix("memory://")
    _fs().pipe_file(f"{path}/notes/readme.txt", b"not a checkpoint")
    for step in range(1, 5):
        rig.save(f"{memory_url}/step-{step}", {"model": model, "step": step}, keep_last=2)
    names = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(path, detail=False))
    assert names == ["last", "notes", "step-3", "step-4"]
    assert rig.load(f"{memory_url}/last")["step"] == 4


def test_a_background_save_uploads_on_its_thread(memory_url: str) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    handle = rig.save(f"{memory_url}/ck", {"model": model, "step": 5}, blocking=False)
    expected = {k: t.clone() for k, t in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1000.0)  # after the call: not in the checkpoint
    assert handle.wait() == f"{memory_url}/ck"
    left = rig.load(f"{memory_url}/last")
    assert left["step"] == 5
    assert left["model"].keys() == expected.keys()
    assert all(torch.equal(t, left["model"][k]) for k, t in expected.items())


def test_link_name_and_a_folder_in_its_place_are_refused(memory_url: str) -> None:
    rig = _rig()
    model, _ = trained_mlp(0)
    with pytest.raises(ValueError, match=r"cannot save to memory://.*/last: 'last' is the link torchrig points at"):
        rig.save(f"{memory_url}/last", {"model": model})
    _fs().pipe_file(f"{memory_url.removeprefix('memory://')}/last/x", b"someone's data")
    with pytest.raises(CheckpointError, match=r"cannot update the 'last' link: .*/last holds objects"):
        rig.save(f"{memory_url}/ck", {"model": model})


def test_a_scheme_without_its_backend_says_what_to_install() -> None:
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"fsspec cannot open gs://b/ck: .*gs:// gcsfs"):
        torchrig.checkpoint.describe("gs://b/ck")


def test_inspect_and_consolidate_read_urls(memory_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchrig.cli import main

    rig = _rig()
    model, _ = trained_mlp(0)
    rig.save(f"{memory_url}/ck", {"model": model, "step": 7})
    info = torchrig.checkpoint.describe(f"{memory_url}/last")
    assert info["step"] == 7 and all(ok for _, _, ok in info["verified"])
    assert info["path"].startswith("memory:///") and "/ck/v-" in info["path"]
    assert main(["checkpoint", "inspect", f"{memory_url}/last"]) == 0
    assert "/ck/v-" in capsys.readouterr().out
    assert main(["checkpoint", "consolidate", f"{memory_url}/last", str(tmp_path / "w.safetensors")]) == 0
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_without_fsspec_a_url_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if it were not installed
    with pytest.raises(
        ImportError, match=r"saving to or loading from s3://b/ck needs fsspec: pip install 'torchrig\[remote\]'"
    ):
        torchrig.checkpoint.describe("s3://b/ck")


def test_the_requests_of_a_save_do_not_grow_with_the_checkpoints_beside_it(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_count and keep_last read every committed checkpoint in the folder: in one listing and
    one concurrent fetch of their meta.json objects, not a listing and a read per checkpoint."""
    rig = _rig()
    model = nn.Linear(2, 2)
    reads: list[str] = []
    inside: list[str] = []  # the request being made (what fsspec does inside it is not another one)
    for name in ("ls", "find", "cat", "cat_file", "info", "exists"):
        real = getattr(MemoryFileSystem, name)

        def op(self: Any, *a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            if inside:
                return _real(self, *a, **kw)
            reads.append(_name)
            inside.append(_name)
            try:
                return _real(self, *a, **kw)
            finally:
                inside.pop()

        monkeypatch.setattr(MemoryFileSystem, name, op)

    def requests_of_a_save(siblings: int) -> list[str]:
        for i in range(siblings):
            rig.save(f"{memory_url}/ck-{len(reads)}-{i}", {"model": model, "step": i})
        reads.clear()
        rig.save(f"{memory_url}/new-{siblings}", {"model": model, "step": 99}, keep_last=100)
        return sorted(reads)

    few = requests_of_a_save(2)
    assert "find" in few and "cat" in few  # the folder listed once, the meta.json objects fetched together
    assert requests_of_a_save(10) == few
