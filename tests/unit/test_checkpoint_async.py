"""Background saves (issue 16, section 4): ``rig.save(..., blocking=False)`` and
``ModelCheckpoint(async_save=True)`` keep every promise of a blocking save.

Only a snapshot is taken in the call; the files are those a blocking save writes; one save at a
time; an error is raised at the next save, wait or load; retention waits for the commit.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchrig
from conftest import python_env
from torchrig.checkpoint import SaveHandle, core, files, tensors

pytestmark = pytest.mark.timeout(60)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))  # trainer_helpers


@pytest.fixture
def rig() -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu")


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


class _Gate:
    """Holds every background write until :meth:`open`, and records the order of writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.log: list[str] = []
        real = core.write

        def gated(rig: Any, target: Path, *args: Any, **kwargs: Any) -> None:
            self.log.append(f"begin {target.name}")
            if threading.current_thread() is not threading.main_thread():
                self.opened.wait(30)
            real(rig, target, *args, **kwargs)
            self.log.append(f"end {target.name}")

        monkeypatch.setattr(core, "write", gated)

    def open(self) -> None:
        self.opened.set()


def test_only_a_snapshot_is_taken_in_the_call(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained()
    history = [1.0, 2.0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moment = opt.state[model[0].weight]["exp_avg"].clone()
    gate = _Gate(monkeypatch)
    handle = rig.save(tmp_path / "ck", {"model": model, "optimizer": opt, "history": history}, blocking=False)
    assert isinstance(handle, SaveHandle) and not handle.done()
    assert not (tmp_path / "ck").exists()
    # Training goes on while the files are written: the weights, the moments and the values change.
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    history.append(3.0)
    gate.open()
    assert handle.wait() == tmp_path / "ck" and handle.done()
    left = rig.load(tmp_path / "last")
    assert left["history"] == [1.0, 2.0]
    assert all(torch.equal(left["model"][k], v) for k, v in before.items())
    assert torch.equal(left["optimizer"]["state"][0]["exp_avg"], moment)
    assert not torch.equal(opt.state[model[0].weight]["exp_avg"], moment)


def test_the_files_are_those_a_blocking_save_writes(rig: torchrig.Rig, tmp_path: Path) -> None:
    model, opt = _trained()
    tied = nn.Linear(4, 4)
    tied_twin = nn.Sequential(tied, nn.Tanh(), nn.Linear(4, 4))
    tied_twin[2].weight = tied.weight  # tied weights are stored once, as an alias
    big = torch.arange(300_000, dtype=torch.float32)  # > 1 MB: goes to a safetensors file of state.pt
    values = {"views": [big[:10], big[5:20]], "big": big, "step": 7}
    state_ = {"model": model, "twin": tied_twin, "optimizer": opt, **values}
    torch.manual_seed(1)
    rig.save(tmp_path / "sync", state_, link=None)
    torch.manual_seed(1)  # the RNG state saved is the same
    rig.save(tmp_path / "async", state_, link=None, blocking=False).wait()
    sync, background = (json.loads((tmp_path / n / "meta.json").read_text()) for n in ("sync", "async"))
    assert sync["files"] == background["files"]  # names, sizes and SHA-256 of every file
    assert sync["entries"] == background["entries"] and sync["tensors"] == background["tensors"]
    left = rig.load(tmp_path / "async")
    assert left["twin"]["2.weight"] is left["twin"]["0.weight"]
    assert torch.equal(left["views"][1], big[5:20]) and torch.equal(left["big"], big)


def test_the_snapshot_keeps_shared_storage_and_copies_it_once() -> None:
    base = torch.arange(12.0)
    tree = {"a": base, "b": [base[2:5], base.view(3, 4).t()], "n": {"x": 1}}
    snapshot = state_host(tree)
    snapshot.ready()
    copied = snapshot.tree
    assert copied["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert copied["b"][0].untyped_storage().data_ptr() == copied["a"].untyped_storage().data_ptr()
    assert copied["b"][1].stride() == base.view(3, 4).t().stride()
    base.add_(100)
    assert torch.equal(copied["b"][1], torch.arange(12.0).view(3, 4).t()) and copied["n"] == {"x": 1}
    assert copied["n"] is not tree["n"]


def state_host(tree: Any) -> Any:
    from torchrig.checkpoint.snapshot import to_host

    return to_host(tree)


def test_one_save_at_a_time_the_next_waits_for_the_previous(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(monkeypatch)
    first = rig.save(tmp_path / "a", {"model": nn.Linear(2, 2), "step": 1}, blocking=False)
    second = threading.Thread(target=rig.save, args=(tmp_path / "b", {"model": nn.Linear(2, 2), "step": 2}))
    second.start()
    second.join(2)  # it waits for the first save, which waits for the gate
    assert gate.log == ["begin a"]
    gate.open()
    second.join(30)
    assert gate.log == ["begin a", "end a", "begin b", "end b"] and first.done()
    assert rig.load(tmp_path / "last")["step"] == 2


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(path: Path, *args: Any, **kwargs: Any) -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(tensors, "write_safetensors", no_space)


def test_an_error_in_the_background_is_raised_at_the_next_save(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(2, 2)
    rig.save(tmp_path / "step-1", {"model": model, "step": 1})
    _full_disk(monkeypatch)
    handle = rig.save(tmp_path / "step-2", {"model": model, "step": 2}, blocking=False)
    while not handle.done():
        threading.Event().wait(0.01)
    monkeypatch.undo()
    with pytest.raises(torchrig.checkpoint.CheckpointError) as err:
        rig.save(tmp_path / "step-3", {"model": model, "step": 3})
    assert str(err.value).startswith(f"no space left on device at {tmp_path / 'step-2'}: the checkpoint needs about")
    assert "nothing was replaced (the previous checkpoint and the link are as they were)" in str(err.value)
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    # Nothing of the failed save is left, step 3 was not started, last is still step 1.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-1"]
    assert rig.load(tmp_path / "last")["step"] == 1
    # Raised once: the next save goes on. The handle itself still says what happened.
    rig.save(tmp_path / "step-3", {"model": model, "step": 3})
    with pytest.raises(torchrig.checkpoint.CheckpointError, match="no space left on device at"):
        handle.wait()


def test_an_error_raised_by_wait_is_not_raised_again_and_load_waits(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(2, 2)
    _full_disk(monkeypatch)
    failed = rig.save(tmp_path / "a", {"model": model}, blocking=False)
    with pytest.raises(torchrig.checkpoint.CheckpointError, match=f"no space left on device at {tmp_path / 'a'}"):
        failed.wait()
    monkeypatch.undo()
    gate = _Gate(monkeypatch)
    rig.save(tmp_path / "b", {"model": model, "step": 2}, blocking=False)  # the error above is not raised again
    threading.Timer(0.5, gate.open).start()
    assert rig.load(tmp_path / "last")["step"] == 2  # load waited for the save under way


def test_the_process_ends_after_its_background_saves_and_a_failure_nobody_waited_for_is_printed(
    tmp_path: Path,
) -> None:
    # The script ends right after two background saves (two Rigs): one that works, one on a full disk.
    script = f"""
import errno, os, torch, torchrig
from torchrig.checkpoint import tensors
real = tensors.write_safetensors
def no_space(path, *a, **k):
    if path.name.startswith("model"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(path, *a, **k)
tensors.write_safetensors = no_space
torchrig.Rig(accelerator="cpu").save({str(tmp_path / "ok")!r}, {{"net": torch.nn.Linear(2, 2)}}, blocking=False)
torchrig.Rig(accelerator="cpu").save({str(tmp_path / "full")!r}, {{"model": torch.nn.Linear(2, 2)}}, blocking=False)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=python_env(), timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"torchrig: the background save of {tmp_path / 'full'} failed and nothing waited for it" in out.stderr
    assert "CheckpointError: no space left on device at" in out.stderr
    assert "/ok" not in out.stderr and not (tmp_path / "full").exists()
    assert sorted(torchrig.checkpoint.describe(tmp_path / "ok")["entries"]) == ["net"]


def test_blocking_must_be_a_bool(rig: torchrig.Rig, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"save\(blocking='no'\) must be True or False"):
        rig.save(tmp_path / "ck", {"step": 1}, blocking="no")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"ModelCheckpoint\(async_save=1\) must be True or False"):
        torchrig.ModelCheckpoint(async_save=1)  # type: ignore[arg-type]


def test_a_bad_value_is_refused_in_the_call(rig: torchrig.Rig, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['fn'\] cannot be saved in a checkpoint"):
        rig.save(tmp_path / "ck", {"fn": lambda: 1}, blocking=False)
    assert not (tmp_path / "ck").exists() and rig.background_saves.pending is None


# -- ModelCheckpoint(async_save=True) ------------------------------------------------------------
def test_model_checkpoint_removes_old_checkpoints_only_after_the_new_one_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_helpers import Regressor, loader, quiet_trainer

    seen: list[tuple[str, list[str]]] = []
    real = files.commit

    def commit(tmp: Path, target: Path) -> None:
        seen.append((target.name, sorted(p.name for p in target.parent.iterdir() if not p.name.startswith("."))))
        real(tmp, target)

    monkeypatch.setattr(files, "commit", commit)
    cb = torchrig.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_last=True, async_save=True)
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[cb])
    trainer.fit(Regressor(), loader(24))  # 6 steps: saves at 2, 4, 6
    names = ["epoch=0-step=2", "epoch=0-step=4", "epoch=0-step=6"]
    # Each checkpoint is committed while its predecessor is still there (the only one kept).
    assert seen == [(names[0], []), (names[1], [names[0], "last"]), (names[2], [names[1], "last"])]
    # The fit ended with the last save committed and its retention done.
    assert trainer.rig.background_saves.pending is None
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [names[2], "last"]
    assert trainer.rig.load(tmp_path / "ck" / "last")["step"] == 6


def test_model_checkpoint_the_fit_fails_on_a_background_error_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_helpers import Regressor, loader, quiet_trainer

    _full_disk(monkeypatch)
    cb = torchrig.ModelCheckpoint(dirpath=tmp_path / "ck", async_save=True)
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[cb])
    with pytest.raises(torchrig.checkpoint.CheckpointError, match=r"no space left on device at .*epoch=0-step=2"):
        trainer.fit(Regressor(), loader(8))
    assert trainer.rig.background_saves.pending is None


def test_an_error_of_the_fit_carries_the_background_error_as_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_helpers import Regressor, loader, quiet_trainer

    class Breaks(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 1:  # the save of step 1 is still running (and fails)
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    _full_disk(monkeypatch)
    cb = torchrig.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, async_save=True)
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[cb])
    with pytest.raises(RuntimeError, match="boom") as err:
        trainer.fit(Breaks(), loader(16))
    notes = getattr(err.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert len(notes) == 1 and notes[0].startswith(
            "torchrig: the background checkpoint save failed as well: CheckpointError: no space left on device at "
        )
    assert trainer.rig.background_saves.pending is None


def test_the_host_copy_is_reused_by_the_next_background_save(rig: torchrig.Rig, tmp_path: Path) -> None:
    model, opt = _trained()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    rig.save(tmp_path / "a", {"model": model, "optimizer": opt}, blocking=False)
    buffers = {s.data_ptr() for group in rig.background_saves.host_buffers._free.values() for s in group}
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    second = {k: v.clone() for k, v in model.state_dict().items()}
    rig.save(tmp_path / "b", {"model": model, "optimizer": opt}, blocking=False).wait()
    assert {s.data_ptr() for group in rig.background_saves.host_buffers._free.values() for s in group} == buffers
    # The second snapshot wrote into the first one's memory only after the first save was committed.
    for name, want in (("a", first), ("b", second)):
        got = rig.load(tmp_path / name)["model"]
        assert all(torch.equal(got[k], v) for k, v in want.items()), name


@pytest.mark.parametrize("stop_at", [2, 3])
def test_a_stop_signal_waits_for_the_background_save_before_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: int
) -> None:
    from trainer_helpers import Regressor, loader, quiet_trainer

    class SendAt(torchrig.Callback):
        """SIGTERM to this process after optimizer step ``step`` (the fit stops at the next boundary)."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == self.step:
                self.step = -1
                os.kill(os.getpid(), signal.SIGTERM)

    committed: list[str] = []
    real = files.commit

    def commit(tmp: Path, target: Path) -> None:
        real(tmp, target)
        committed.append(target.name)

    monkeypatch.setattr(files, "commit", commit)
    folder = tmp_path / "ck"
    cb = torchrig.ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True, async_save=True)
    callbacks = [cb, SendAt(stop_at)]
    trainer = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=callbacks)
    with pytest.raises(torchrig.Preempted) as info:
        trainer.fit(Regressor(), loader(40))
    # The background save of step 2 is committed first; the stop at step 3 then saves step 3 (at
    # step 2 that checkpoint already is last). Nothing is left running when the fit has raised.
    want = ["epoch=0-step=2"] if stop_at == 2 else ["epoch=0-step=2", "epoch=0-step=3"]
    assert committed == want and trainer.rig.background_saves.pending is None
    assert info.value.saved == str(folder / want[-1]) and (folder / "last").resolve().name == want[-1]
    assert trainer.rig.load(folder / "last")["step"] == stop_at


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
def test_a_full_disk_in_a_background_sharded_save_is_raised_at_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model = rig.prepare(nn.Linear(64, 64))
    rig.save(tmp_path / "step-1", {"model": model, "step": 1}, blocking=False).wait()

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    handle = rig.save(tmp_path / "step-2", {"model": model, "step": 2}, blocking=False)
    with pytest.raises(torchrig.checkpoint.CheckpointError, match=f"no space left on device at {tmp_path / 'step-2'}"):
        rig.save(tmp_path / "step-3", {"model": model, "step": 3})
    monkeypatch.undo()
    assert handle.done() and sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-1"]
    assert rig.load(tmp_path / "last", {"model": model})["step"] == 1


def test_the_optimizer_state_is_copied_in_the_background_and_the_next_step_waits_for_it(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrig.checkpoint import snapshot

    model, opt = _trained()
    moment = opt.state[model[0].weight]["exp_avg"].clone()
    held, log = threading.Event(), []
    real = snapshot._copy_later

    def copy_later(later: Any) -> None:
        held.wait(30)
        real(later)
        log.append("copied")

    monkeypatch.setattr(snapshot, "_copy_later", copy_later)
    handle = rig.save(tmp_path / "ck", {"model": model, "optimizer": opt}, blocking=False)
    model(torch.randn(3, 4)).sum().backward()  # the next forward and backward run meanwhile
    threading.Timer(0.3, held.set).start()
    opt.step()  # waits for the copy of the moments
    log.append("stepped")
    handle.wait()
    assert log == ["copied", "stepped"]
    assert torch.equal(rig.load(tmp_path / "ck")["optimizer"]["state"][0]["exp_avg"], moment)
    assert not opt._optimizer_step_pre_hooks  # the hook is gone once the save is over


def test_optimizer_state_changed_before_its_background_copy_is_refused(
    rig: torchrig.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrig.checkpoint import snapshot

    model, opt = _trained()
    rig.save(tmp_path / "ck", {"model": model, "optimizer": opt, "step": 1})
    held = threading.Event()
    real = snapshot._copy_later

    def copy_later(later: Any) -> None:
        held.wait(30)
        real(later)

    monkeypatch.setattr(snapshot, "_copy_later", copy_later)
    handle = rig.save(tmp_path / "ck", {"model": model, "adam": opt, "step": 2}, blocking=False)
    with torch.no_grad():
        opt.state[model[0].weight]["exp_avg"].mul_(0.5)  # not through optimizer.step()
    held.set()
    with pytest.raises(RuntimeError) as err:
        handle.wait()
    assert str(err.value) == (
        "the state of optimizer 'adam' was changed in place after rig.save(..., blocking=False) returned and "
        "before the background save had copied it; only optimizer.step() may change it then (it waits for the "
        "copy). Nothing was written"
    )
    assert rig.load(tmp_path / "last")["step"] == 1


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("reusable", [True, False])
def test_background_sharded_saves_on_a_torch_whose_staging_closes_the_stager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reusable: bool
) -> None:
    """torch before 2.13 (seen on 2.11) closes DCP's stager as it stages, so a stager kept for the
    next save fails there (KeyError: <class 'type'>): before 2.13 each save gets its own."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from torchrig.checkpoint import sharded

    staged: list[DefaultStager] = []
    closed: list[DefaultStager] = []
    real_stage, real_close = DefaultStager.stage, DefaultStager.close

    def stage_like_torch_2_11(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        if self in staged:
            raise KeyError(type)  # what the copier that staging cleared raises on torch 2.11
        staged.append(self)
        return real_stage(self, state_dict, **kwargs)

    def close(self: DefaultStager) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(DefaultStager, "stage", stage_like_torch_2_11)
    monkeypatch.setattr(DefaultStager, "close", close)
    monkeypatch.setattr(sharded, "STAGER_REUSABLE", reusable)
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    model = rig.prepare(nn.Linear(8, 8))
    rig.save(tmp_path / "step-1", {"model": model, "step": 1}, blocking=False).wait()
    if reusable:  # the kept stager fails the next save, as on torch 2.11
        with pytest.raises(KeyError):
            rig.save(tmp_path / "step-2", {"model": model, "step": 2}, blocking=False).wait()
        return
    rig.save(tmp_path / "step-2", {"model": model, "step": 2}, blocking=False).wait()
    assert rig.load(tmp_path / "last", {"model": model})["step"] == 2
    assert len(staged) == 2 and closed == staged  # a stager each, closed after its save
