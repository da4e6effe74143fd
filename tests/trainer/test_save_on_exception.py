"""ModelCheckpoint(save_on_exception=True): ``last`` when the fit raises, on every rank together, then
the error; nothing (and no hang) when only one rank raises; not for KeyboardInterrupt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, printed_json, quiet_trainer, subprocess_env

import torchrig
from torchrig.strategies.agreement import every_rank_arrives


class FailsAtStep(Regressor):
    """Raises ``error`` in training_step once ``global_step`` reaches ``step`` (on the ranks in ``ranks``)."""

    def __init__(self, step: int, error: BaseException, ranks: tuple[int, ...] = (0,)) -> None:
        super().__init__()
        self.step, self.error, self.ranks = step, error, ranks

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.step and self.trainer.global_rank in self.ranks:
            raise self.error
        return super().training_step(batch, batch_idx)


def checkpoint(tmp_path: Path, **kwargs: Any) -> torchrig.ModelCheckpoint:
    return torchrig.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_on_exception=True, save_top_k=0, **kwargs)


def test_the_error_saves_last_at_that_step_and_propagates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint(tmp_path)])
    with pytest.raises(ValueError, match=r"^bad batch$"):
        trainer.fit(FailsAtStep(3, ValueError("bad batch")), loader(32, batch_size=4))
    last = tmp_path / "ckpt" / "last"
    assert last.resolve().name == "epoch=0-step=3"
    assert "torchrig: ValueError at epoch 0, batch 3, step 3: saved it as " in capsys.readouterr().out
    # loadable: the fit resumes at step 3; the batch that raised was taken from the loader, so it
    # counts as seen and the resumed fit trains the 4 after it (a batch that always fails is passed)
    resumed = quiet_trainer(tmp_path, max_epochs=1)
    resumed.fit(Regressor(), loader(32, batch_size=4), ckpt_path=last)
    assert resumed.global_step == 3 + 4


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)])
def test_interrupts_and_exits_save_nothing(tmp_path: Path, error: BaseException) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint(tmp_path)])
    with pytest.raises(type(error)):
        trainer.fit(FailsAtStep(3, error), loader(32, batch_size=4))
    assert not (tmp_path / "ckpt").exists()


def test_without_save_on_exception_nothing_is_saved(tmp_path: Path) -> None:
    cb = torchrig.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0)
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[cb])
    with pytest.raises(ValueError, match=r"^bad batch$"):
        trainer.fit(FailsAtStep(3, ValueError("bad batch")), loader(32, batch_size=4))
    assert not (tmp_path / "ckpt").exists()


def test_an_error_before_the_fit_started_saves_nothing(tmp_path: Path) -> None:
    class NoOptimizer(Regressor):
        def configure_optimizers(self) -> Any:
            raise RuntimeError("no optimizer today")

    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint(tmp_path)])
    with pytest.raises(RuntimeError, match="no optimizer today"):
        trainer.fit(NoOptimizer(), loader(8))
    assert not (tmp_path / "ckpt").exists()


def test_a_failing_save_does_not_hide_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint(tmp_path)])
    # Put there after the ModelCheckpoint was made (given at first, dirpath= is refused at once).
    (tmp_path / "ckpt").write_text("a file where the folder should be")
    with pytest.raises(ValueError, match=r"^bad batch$"):
        trainer.fit(FailsAtStep(2, ValueError("bad batch")), loader(32, batch_size=4))
    assert "torchrig: rank 0: save_on_exception could not save: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"save_on_exception": "yes"}, TypeError, "ModelCheckpoint(save_on_exception='yes') must be True or False"),
        (
            {"save_on_exception_timeout": -1},
            ValueError,
            "ModelCheckpoint(save_on_exception_timeout=-1 must be a finite number >= 0 seconds)",
        ),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        torchrig.ModelCheckpoint(**kwargs)
    assert str(info.value) == message


def test_the_store_decision_is_the_same_for_every_rank_that_asks() -> None:
    """A rank that arrives after the others gave up reads their "not every rank" (it must not
    save alone); ranks that all arrive in time all read "every rank"."""
    import threading

    import torch.distributed as dist

    store = dist.HashStore()
    late = every_rank_arrives(store, 2, "once", timeout=0.1)
    assert (late.everyone, late.arrived) == (False, 1)
    assert not every_rank_arrives(store, 2, "once", timeout=5).everyone  # the second rank, too late
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(every_rank_arrives(store, 2, "both", 5).everyone))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]
    assert every_rank_arrives(None, 1, "alone", 0).everyone


SCRIPT = r"""
import json, os, sys
import torch
import torchrig
from trainer_helpers import Regressor, loader
from test_save_on_exception import FailsAtStep

ranks = tuple(int(r) for r in sys.argv[2].split(","))
root = sys.argv[1]
cb = torchrig.ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=0, save_on_exception=True,
                              save_on_exception_timeout=3)
trainer = torchrig.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, timeout=20, logger=False,
                           enable_progress_bar=False, default_root_dir=root, callbacks=[cb])
try:
    trainer.fit(FailsAtStep(3, ValueError(f"bad batch on rank {trainer.global_rank}"), ranks),
                loader(32, batch_size=2))
except ValueError as err:
    caught = str(err)
else:
    caught = None
last = os.path.join(root, "ckpt", "last")
resumed_at = None
if caught is not None and os.path.lexists(last):
    again = torchrig.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                             enable_progress_bar=False, enable_checkpointing=False, default_root_dir=root)
    module = Regressor()
    again.fit(module, loader(32, batch_size=2), ckpt_path=last)
    resumed_at = again.global_step
saved = os.path.basename(os.path.realpath(last)) if os.path.lexists(last) else None
row = {"rank": trainer.global_rank, "caught": caught, "resumed_steps": resumed_at, "last": saved}
sys.stdout.write(json.dumps(row) + "\n")
"""


def run_two(tmp_path: Path, ranks: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), ranks],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_every_rank_raising_at_the_same_step_saves_that_step_on_both(tmp_path: Path) -> None:
    done = run_two(tmp_path, "0,1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted(printed_json(done.stdout), key=str)
    assert [r["caught"] for r in rows] == ["bad batch on rank 0", "bad batch on rank 1"]  # the error went on
    assert [r["last"] for r in rows] == ["epoch=0-step=3", "epoch=0-step=3"]
    assert [r["resumed_steps"] for r in rows] == [7, 7]  # 8 batches a rank: step 3, then the 4 after the failed one
    assert "torchrig: ValueError at epoch 0, batch 3, step 3: saved it as " in done.stdout


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_one_rank_raising_saves_nothing_says_why_and_does_not_hang(tmp_path: Path) -> None:
    done = run_two(tmp_path, "1")
    assert done.returncode != 0  # rank 0 was waiting for rank 1 in the step's gradient all-reduce
    assert (
        "torchrig: rank 1: ValueError at epoch 0, batch 3, step 3, but only 1 of 2 ranks raised there within 3 s; "
        "a save needs every rank, so ModelCheckpoint(save_on_exception=True) saved nothing" in done.stderr
    ), done.stderr[-3000:]
    rows = printed_json(done.stdout)
    assert rows == [{"rank": 1, "caught": "bad batch on rank 1", "resumed_steps": None, "last": None}]
    # rank 0's all-reduce failed when rank 1 left; it did not save either
    assert "torchrig: rank 0: RuntimeError at epoch 0, batch 3, step 3, but the ranks did not all raise" in done.stderr
    assert not os.path.lexists(tmp_path / "ckpt" / "last")
