"""A kill at any point of a save that replaces a checkpoint never loses ``last``; saves on a shared
file system touch only their own leftovers; files follow the umask; retention races are harmless."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchrig
from conftest import python_env
from torchrig.checkpoint import files, progress

# One process imports torch once, then for every k forks a child that saves step 2 over step 1
# (same name, ``last`` pointing at it) and dies (os._exit: no clean-up, as SIGKILL) at its k-th
# file-system change. The parent then loads ``last`` as it is, saves step 3 (which must tidy
# every leftover) and reports what it found. In mode "async" the child saves in the background
# (rig.save(..., blocking=False)) and changes the weights at once, as training would: it dies on
# the save's thread, and what loads must be the weights of the call.
DRIVER = r"""
import json, os, shutil, sys, warnings
import torch
import torchrig
from torchrig.checkpoint import files

root, mode = sys.argv[1], sys.argv[2]
rig = torchrig.Rig(accelerator="cpu")
model = torch.nn.Linear(3, 3)
base = os.path.join(root, "base")
rig.save(os.path.join(base, "ck"), {"model": model, "step": 1})
background = mode == "async"
if mode == "fallback":
    files.exchange = lambda a, b: False  # an OS or file system without renameat2(RENAME_EXCHANGE)
elif not files.exchange(os.path.join(base, "ck"), os.path.join(base, "ck")):  # same path: a no-op swap
    print(json.dumps({"no_exchange": True}))
    sys.exit(0)

def patched(k, seen):
    def wrap(owner, name):
        real = getattr(owner, name)
        def op(*a, **kw):
            seen.append(name)
            if len(seen) == k:
                os._exit(17)
            return real(*a, **kw)
        setattr(owner, name, op)
    for owner, name in [(os, "rename"), (os, "replace"), (os, "symlink"), (os, "unlink"), (shutil, "rmtree")]:
        wrap(owner, name)
    if mode != "fallback":
        wrap(files, "exchange")

def replace_step_1(k):
    d = os.path.join(root, f"k{k}")
    shutil.copytree(base, d, symlinks=True)
    pid = os.fork()
    if pid == 0:
        seen = []
        patched(k, seen)
        handle = rig.save(os.path.join(d, "ck"), {"model": model, "step": 2}, blocking=not background)
        if background:
            with torch.no_grad():
                model.weight.add_(1000.0)  # the step after the call: not in the checkpoint
            handle.wait()
        with open(os.path.join(root, "ops.json"), "w") as f:
            json.dump(seen, f)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return d, os.waitstatus_to_exitcode(status)

replace_step_1(0)  # never killed: the file-system changes of the save, in order
with open(os.path.join(root, "ops.json")) as f:
    ops = json.load(f)
results = []
for k in range(1, len(ops) + 2):
    d, code = replace_step_1(k)
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            left = rig.load(os.path.join(d, "last"))
        step, weights = left["step"], torch.equal(left["model"]["weight"], model.weight)
    except Exception as err:
        step, weights = f"{type(err).__name__}: {err}", False
    rig.save(os.path.join(d, "ck"), {"model": model, "step": 3})
    after = rig.load(os.path.join(d, "last"))["step"]
    op = ops[k - 1] if k <= len(ops) else "none (finished)"
    left = sorted(os.listdir(d))
    results.append({"k": k, "op": op, "code": code, "step": step, "weights": weights, "after": after, "left": left})
print(json.dumps(results))
"""


def _kill_everywhere(tmp_path: Path, mode: str) -> list[dict[str, Any]]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = python_env()
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if isinstance(result, dict):
        pytest.skip("this OS or file system has no renameat2(RENAME_EXCHANGE)")
    return result


@pytest.mark.slow  # a killed process per step: 2.2 s of CPU each (measured on the shared 2-core machine)
@pytest.mark.timeout(110)
@pytest.mark.parametrize("mode", ["exchange", "fallback", "async"])
def test_a_kill_at_every_step_of_a_replacing_save_never_loses_last(tmp_path: Path, mode: str) -> None:
    results = _kill_everywhere(tmp_path, mode)
    ops = [r["op"] for r in results]
    # The ops that change what is at ck or last are all among the kill points (rmtree's own unlinks too).
    needed = ["rename", "rename"] if mode == "fallback" else ["exchange"]
    assert [o for o in ops if o in ("exchange", "rename")] == needed, ops
    assert ops.count("symlink") == 1 and ops.count("replace") == 1 and "rmtree" in ops, ops
    assert [r["code"] for r in results] == [17] * (len(results) - 1) + [0], results
    for r in results:
        assert r["step"] in (1, 2), f"killed at {r['op']} (change {r['k']}): loading last gave {r['step']!r}"
        assert r["weights"], r  # step 1's, or the snapshot step 2 took in the call
        # The next save tidies every leftover (temp dirs, old copies, temp links) and is what last is.
        assert r["after"] == 3 and r["left"] == ["ck", "last"], r
    # Before the checkpoint is replaced the old one loads, after it the new one: both are seen.
    assert {r["step"] for r in results} == {1, 2}


def _named(
    folder: Path, kind: str, *, host: str | None = None, boot: str | None = None, ns: str | None = None, pid: int
) -> Path:
    """A leftover of ``folder/ck`` as a save of that host, boot, pid namespace and pid would name it."""
    h, b, n = files._origin()
    return folder / f".ck.{kind}-{host or h}.{boot or b}.{ns or n}-{pid}-abcd1234"


def _save(rig: torchrig.Rig, path: Path, step: int, **kwargs: Any) -> Path:
    return rig.save(path, {"model": nn.Linear(2, 2), "step": step}, **kwargs)


@pytest.fixture
def rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


@pytest.mark.timeout(20)
def test_a_dangling_last_loads_the_previous_copy_and_the_next_save_puts_it_back(
    rig: torchrig.Rig, tmp_path: Path
) -> None:
    _save(rig, tmp_path / "ck", 1)
    # Killed between the two renames of a replace where no atomic exchange exists: last -> ck dangles.
    old = _named(tmp_path, "old", pid=999_999_999)  # by a save that is dead now
    os.rename(tmp_path / "ck", old)
    with pytest.warns(UserWarning, match="a save was interrupted while replacing it; loading the previous"):
        assert rig.load(tmp_path / "last")["step"] == 1
    # The next save, of another name, repairs ck from its copy (it is the only whole one) ...
    _save(rig, tmp_path / "other", 2, link=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "last", "other"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rig.load(tmp_path / "last")["step"] == 1
    # ... and a stale copy next to a present ck is removed.
    os.rename(tmp_path / "ck", old)
    _save(rig, tmp_path / "ck", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "last", "other"]


# -- shared file systems and other users -------------------------------------------------------
def _foreign(tmp_path: Path, kind: str, *, pid: int, **owner: str) -> Path:
    p = _named(tmp_path, kind, pid=pid, **owner)
    p.mkdir()
    return p


@pytest.mark.timeout(20)
def test_only_leftovers_of_this_host_boot_and_namespace_whose_process_died_are_reaped(
    rig: torchrig.Rig, tmp_path: Path
) -> None:
    dead_here = _foreign(tmp_path, "tmp", pid=999_999_999)  # no such pid here
    alive_here = _foreign(tmp_path, "tmp", pid=os.getpid())
    other_host = _foreign(tmp_path, "tmp", host="0badc0de", pid=999_999_999)  # its pids mean nothing here
    other_host_old = _foreign(tmp_path, "old", host="0badc0de", pid=999_999_998)
    earlier_boot = _foreign(tmp_path, "tmp", boot="0badc0de", pid=os.getpid())
    os.utime(earlier_boot, (0, 0))  # last changed before this machine booted
    newer_other_boot = _foreign(tmp_path, "tmp", boot="0badc0de", pid=999_999_997)  # same name, another machine
    container = _foreign(tmp_path, "tmp", ns="0badc0de", pid=999_999_996)  # another pid namespace here
    legacy = tmp_path / ".ck.tmp-999999999-abcd1234"  # no owner in the name: whose it is is unknown
    legacy.mkdir()
    _save(rig, tmp_path / "step-2", 2)
    assert not dead_here.exists() and not earlier_boot.exists()
    assert alive_here.exists() and other_host.exists() and other_host_old.exists()
    assert newer_other_boot.exists() and container.exists() and legacy.exists()


def test_temp_names_carry_the_host_boot_and_pid_namespace() -> None:
    host, boot, ns = files._origin()
    p = files.leftover_name(Path("/x/ck"), "tmp")
    m = files._LEFTOVER.fullmatch(p.name)
    assert m is not None and (m["name"], m["kind"], m["host"], m["boot"], m["ns"]) == ("ck", "tmp", host, boot, ns)
    assert int(m["pid"]) == os.getpid()


@pytest.mark.timeout(20)
def test_every_file_follows_the_umask(rig: torchrig.Rig, tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        path = rig.save(tmp_path / "run" / "ck", {"model": model, "optimizer": opt, "step": 1})
        out = torchrig.checkpoint.consolidate(path, tmp_path / "weights.safetensors")
    finally:
        os.umask(before)
    entries = [path.parent, path, *path.iterdir(), out]
    assert any(p.name.endswith(".safetensors") for p in path.iterdir())
    for p in entries:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), f"{p} is {oct(mode)}"


@pytest.mark.timeout(20)
def test_retention_moves_on_past_a_checkpoint_another_process_removed(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (1, 2, 3):
        _save(rig, tmp_path / f"step-{step}", step, link=None)
    # The other process prunes step-1 after this one listed the folder (its own retention ran
    # between this one's listing and removal): this one's removal then finds it gone.
    real = progress.read_meta_quiet
    listings = []

    def listed_then_removed(folder: Path) -> dict[str, Any] | None:
        meta = real(folder)
        if folder.name == "step-1":
            listings.append(folder)
            if len(listings) == 2:  # the first listing numbers the save (save_count), the second is retention's
                files.discard(folder)
        return meta

    monkeypatch.setattr(progress, "read_meta_quiet", listed_then_removed)
    path = _save(rig, tmp_path / "step-4", 4, keep_last=2, link=None)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    assert rig.load(path)["step"] == 4
