"""``fit(ckpt_path="last")`` after a SIGKILL ends bitwise equal to the run that was never killed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer, subprocess_env

import torchrig

SCRIPT = r"""
import os, signal, sys
import torch
import torchrig
from trainer_helpers import Regressor, loader

root, kill_at, accumulate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


class Kill(torchrig.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind: a crash


torch.manual_seed(0)
module = Regressor(dropout=0.25)  # dropout: the RNG stream must continue exactly too
trainer = torchrig.Trainer(
    accelerator="cpu", devices=1, max_epochs=2, seed=123, deterministic=True, accumulate_grad_batches=accumulate,
    enable_progress_bar=False, logger=False, default_root_dir=root, num_sanity_val_steps=1,
    callbacks=[Kill(), torchrig.ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=1)],
)
trainer.fit(module, loader(24, batch_size=4, shuffle=True), loader(8), ckpt_path="last")
torch.save({k: v for k, v in module.state_dict().items()}, os.path.join(root, "final.pt"))
print("steps", trainer.global_step, "epoch", trainer.current_epoch)
"""


def _run(tmp: Path, root: str, kill_at: int, accumulate: int) -> subprocess.CompletedProcess[str]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp / root), str(kill_at), str(accumulate)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    # 6 batches an epoch, a step every 2 batches, a checkpoint every 2 steps: killed at step 5,
    # the newest checkpoint is step 4, two batches into the second epoch.
    kill_at, accumulate = 5, 2
    clean = _run(tmp_path, "clean", -1, accumulate)
    assert clean.returncode == 0, clean.stderr
    killed = _run(tmp_path, "killed", kill_at, accumulate)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "killed" / "final.pt").exists()
    # The newest checkpoint is from before the kill, in the middle of an epoch.
    last = (tmp_path / "killed" / "checkpoints" / "last").resolve()
    assert last.name == "epoch=1-step=4"
    resumed = _run(tmp_path, "killed", -1, accumulate)
    assert resumed.returncode == 0, resumed.stderr
    said, *rest = resumed.stdout.splitlines()
    link = last.parent / "last"
    assert said == f"torchrig: resumed from {link} -> epoch=1-step=4: continues in epoch 1/1 after 2 batches, step 4"
    assert rest == clean.stdout.splitlines()
    a = torch.load(tmp_path / "clean" / "final.pt")
    b = torch.load(tmp_path / "killed" / "final.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise


@pytest.mark.timeout(20)
def test_last_without_a_checkpoint_starts_fresh_with_a_warning(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_steps=2, enable_checkpointing=True)
    with pytest.warns(UserWarning, match="ckpt_path='last': there is no checkpoint at"):
        trainer.fit(Regressor(), loader(8), ckpt_path="last")
    assert trainer.global_step == 2
    assert (tmp_path / "checkpoints" / "last").is_symlink()


@pytest.mark.timeout(20)
def test_resume_at_an_epoch_end_continues_with_the_next_epoch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Regressor()
    first = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, limit_train_batches=3)
    first.fit(module, loader(32))
    assert (first.current_epoch, first.global_step) == (1, 3)
    second = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, limit_train_batches=3)
    seen: list[tuple[int, int]] = []

    class Watch(torchrig.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append((trainer.current_epoch, batch_idx))

    second.callbacks.insert(0, Watch())
    second.fit(Regressor(), loader(32), ckpt_path="last")
    assert seen == [(1, 0), (1, 1), (1, 2)]
    assert (second.current_epoch, second.global_step) == (2, 6)


@pytest.mark.timeout(20)
def test_validate_from_a_checkpoint_loads_the_weights(tmp_path: Path) -> None:
    module = Regressor()
    trainer = quiet_trainer(tmp_path, max_steps=3, enable_checkpointing=True)
    trainer.fit(module, loader(16))
    expected = trainer.validate(module, loader(8))
    fresh = Regressor()
    got = quiet_trainer(tmp_path).validate(fresh, loader(8), ckpt_path=tmp_path / "checkpoints" / "last")
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), module.parameters(), strict=True))
    best = trainer.validate(module, loader(8), ckpt_path="best")  # the newest is the best without monitor
    assert best == expected
    with pytest.raises(ValueError, match="ckpt_path='best' needs a ModelCheckpoint that has saved a checkpoint"):
        quiet_trainer(tmp_path).validate(fresh, loader(8), ckpt_path="best")


@pytest.mark.timeout(30)
def test_resume_with_another_batch_size_continues_at_the_same_sample(tmp_path: Path) -> None:
    # Saved after 3 batches of 4 (12 samples of epoch 0's order); resumed with batches of 6:
    # the epoch goes on at sample 12 (batch 2 of 6 of the new layout), not at batch 3 (sample 18).
    torch.manual_seed(0)
    save = torchrig.ModelCheckpoint(every_n_train_steps=3, save_last=True)
    first = quiet_trainer(tmp_path, max_steps=3, seed=7, enable_checkpointing=True, callbacks=[save])
    first.fit(Regressor(), loader(36, batch_size=4, shuffle=True))
    assert (tmp_path / "checkpoints" / "last").resolve().name == "epoch=0-step=3"
    seen: list[tuple[int, int, torch.Tensor]] = []

    class Watch(torchrig.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append((trainer.current_epoch, batch_idx, batch[0].clone()))

    second = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, seed=7, callbacks=[Watch()])
    second.fit(Regressor(), loader(36, batch_size=6, shuffle=True), ckpt_path="last")
    assert [(e, i) for e, i, _ in seen] == [(0, 2), (0, 3), (0, 4), (0, 5)]
    # The samples are the rest of epoch 0's order: what a fresh batch-6 run sees from batch 2 on.
    order: list[torch.Tensor] = []

    class Record(torchrig.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            order.append(batch[0].clone())

    fresh = quiet_trainer(tmp_path / "fresh", max_epochs=1, seed=7, callbacks=[Record()])
    fresh.fit(Regressor(), loader(36, batch_size=6, shuffle=True))
    assert all(torch.equal(a, b) for (_, _, a), b in zip(seen, order[2:], strict=True))


def test_save_checkpoint_without_a_run_in_this_process_says_where_the_run_is(tmp_path: Path) -> None:
    """Before any fit there is no run to save; under ddp_spawn the runs live in the started
    processes, and the launching process is told what it holds and where to save instead."""
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    with pytest.raises(RuntimeError, match=r"saves a run: call fit/validate/test/predict with a module first"):
        trainer.save_checkpoint(tmp_path / "ck")
    spawn = quiet_trainer(tmp_path, max_epochs=1, devices=2, strategy="ddp_spawn")
    with pytest.raises(RuntimeError) as err:
        spawn.save_checkpoint(tmp_path / "ck")
    text = str(err.value)
    assert "under DDPStrategy (ddp_spawn, ddp_notebook) the runs live in the processes" in text
    assert "holds the trained weights (module.state_dict())" in text and "ModelCheckpoint" in text
    assert not (tmp_path / "ck").exists()


@pytest.mark.timeout(30)
def test_an_explicit_save_in_the_callbacks_folder_leaves_its_last_where_it_was(tmp_path: Path) -> None:
    # Lightning's rule: trainer.save_checkpoint(path) writes that checkpoint and nothing else. The
    # callback's ``last`` (what ckpt_path="last" resumes) stays on the callback's newest checkpoint.
    save = torchrig.ModelCheckpoint(every_n_train_steps=2, save_last=True)
    first = quiet_trainer(tmp_path, max_steps=2, enable_checkpointing=True, callbacks=[save])
    first.fit(Regressor(), loader(16))
    folder = tmp_path / "checkpoints"
    assert (folder / "last").resolve().name == "epoch=0-step=2"
    assert first.save_checkpoint(folder / "by-hand") == folder / "by-hand"
    assert (folder / "by-hand" / "meta.json").is_file()
    assert (folder / "last").resolve().name == "epoch=0-step=2"  # not moved to "by-hand"
    assert save.last_model_path == str(folder / "epoch=0-step=2")
    first.save_checkpoint(folder / "pointed", link="last")  # asked for: the link moves
    assert (folder / "last").resolve().name == "pointed"


@pytest.mark.timeout(30)
def test_the_name_the_resume_message_and_the_progress_bar_say_the_same_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Stopped in the second epoch (index 1) after 1 of its 3 batches: the checkpoint is named
    # epoch=1-..., the resume says epoch 1/2 (of 0..2) and the progress bar's line too.
    import io

    from rich.console import Console

    save = torchrig.ModelCheckpoint(every_n_train_steps=4, save_last=True)
    first = quiet_trainer(tmp_path, max_epochs=3, max_steps=4, enable_checkpointing=True, callbacks=[save])
    first.fit(Regressor(), loader(12))  # 3 batches of 4 an epoch
    link = tmp_path / "checkpoints" / "last"
    assert link.resolve().name == "epoch=1-step=4"
    capsys.readouterr()
    out = io.StringIO()
    bar = torchrig.ProgressBar(console=Console(file=out, width=200))
    second = quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[bar])
    second.fit(Regressor(), loader(12), ckpt_path="last")
    said = capsys.readouterr().out
    assert f"torchrig: resumed from {link} -> epoch=1-step=4: continues in epoch 1/2 after 1 batches, step 4" in said
    lines = [line for line in out.getvalue().splitlines() if line.startswith("Epoch ")]
    assert [line.split(":")[0] for line in lines] == ["Epoch 1/2", "Epoch 2/2"], lines


@pytest.mark.timeout(30)
def test_a_resumed_fit_skips_the_sanity_check(tmp_path: Path) -> None:
    """docs/trainer.md: "A resumed fit skips the sanity check" (a first fit runs it)."""

    class Sanity(torchrig.Callback):
        def __init__(self) -> None:
            self.checks = 0

        def on_sanity_check_start(self, trainer: Any, module: Any) -> None:
            self.checks += 1

    first, second = Sanity(), Sanity()
    kw: dict[str, Any] = {"enable_checkpointing": True, "num_sanity_val_steps": 2}
    quiet_trainer(tmp_path, max_epochs=1, callbacks=[first], **kw).fit(Regressor(), loader(16), loader(8))
    assert first.checks == 1
    resumed = quiet_trainer(tmp_path, max_epochs=2, callbacks=[second], **kw)
    resumed.fit(Regressor(), loader(16), loader(8), ckpt_path="last")
    assert second.checks == 0 and resumed.global_step == 8


@pytest.mark.timeout(30)
def test_a_fit_stopped_by_max_steps_inside_an_epoch_ends_it_and_its_checkpoint_resumes_the_next(
    tmp_path: Path,
) -> None:
    """docs/trainer.md: a fit that ``max_steps`` stops inside an epoch ends that epoch as Lightning
    does (its epoch-end hooks run, ``current_epoch`` moves on), so resuming from the checkpoint
    written at the end of that fit starts the next epoch."""
    seen: list[Any] = []

    class Watch(torchrig.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append((trainer.current_epoch, batch_idx))

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            seen.append(("epoch end", trainer.current_epoch, trainer.global_step))

    first = quiet_trainer(tmp_path, max_epochs=2, max_steps=3, enable_checkpointing=True, callbacks=[Watch()])
    first.fit(Regressor(), loader(32))  # 8 batches an epoch
    assert seen == [(0, 0), (0, 1), (0, 2), ("epoch end", 0, 3)]
    assert (first.current_epoch, first.global_step) == (1, 3)
    assert (tmp_path / "checkpoints" / "last").resolve().name == "epoch=0-step=3"
    seen.clear()
    resumed = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[Watch()])
    resumed.fit(Regressor(), loader(32), ckpt_path="last")
    assert seen[0] == (1, 0) and (resumed.current_epoch, resumed.global_step) == (2, 11)
