"""Where a Trainer writes by default, and what ``ckpt_path="last"`` finds (issue 15, item 9).

Each run's checkpoints go into its logger's run directory (``torchrig_logs/version_N/checkpoints``),
so runs never share a ``last``; a new run asked for ``"last"`` continues the newest earlier run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, subprocess_env

import torchrig
from torchrig.trainer.loggers import read_metrics


def _trainer(root: Path, **kwargs: Any) -> torchrig.Trainer:
    """The Trainer's defaults (CSV logger, default checkpointing) on the CPU, without the bar."""
    return torchrig.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False, default_root_dir=root, **kwargs)


def _last(root: Path, version: int) -> Path:
    return root / "torchrig_logs" / f"version_{version}" / "checkpoints" / "last"


@pytest.mark.timeout(30)
def test_each_run_checkpoints_into_its_own_version_directory(tmp_path: Path) -> None:
    first = _trainer(tmp_path, max_epochs=2, log_every_n_steps=1)
    first.fit(Regressor(), loader(8))
    second = _trainer(tmp_path, max_epochs=1, log_every_n_steps=1)
    second.fit(Regressor(), loader(8))
    # (Only the step is checked in the names: how they count epochs is tested elsewhere.)
    assert _last(tmp_path, 0).resolve().name.endswith("-step=4")  # not moved by the second run
    assert _last(tmp_path, 1).resolve().name.endswith("-step=2")
    assert not (tmp_path / "checkpoints").exists()
    assert first.checkpoint_callback is not None
    assert first.checkpoint_callback.last_model_path == str(_last(tmp_path, 0).resolve())
    assert len(read_metrics(tmp_path / "torchrig_logs" / "version_0")) > 0


@pytest.mark.timeout(30)
def test_last_continues_the_newest_earlier_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _trainer(tmp_path, max_epochs=3, log_every_n_steps=1).fit(Regressor(), loader(8))  # version_0: 6 steps
    _trainer(tmp_path, max_epochs=1, log_every_n_steps=1).fit(Regressor(), loader(8))  # version_1: 2 steps
    capsys.readouterr()
    third = _trainer(tmp_path, max_epochs=2, log_every_n_steps=1)
    third.fit(Regressor(), loader(8), ckpt_path="last")
    # version_1 is the newest run with a `last` (version_2, this run's own folder, has none yet).
    said = f"torchrig: resumed from {_last(tmp_path, 1)} -> {_last(tmp_path, 1).resolve().name}: "
    assert said + "continues with epoch 1/1, step 2" in capsys.readouterr().out
    assert (third.current_epoch, third.global_step) == (2, 4)
    assert _last(tmp_path, 2).resolve().name.endswith("-step=4")
    assert _last(tmp_path, 1).resolve().name.endswith("-step=2")  # the run resumed from is as it was
    # With a `last` of its own (the same Trainer fitting again), a run continues that one.
    third.fit(Regressor(), loader(8), ckpt_path="last")
    assert f"resumed from {_last(tmp_path, 2)} -> {_last(tmp_path, 2).resolve().name}: " in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_last_passes_over_an_earlier_run_that_died_before_its_first_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/trainer.md: ``"last"`` of a new run is that of the highest-numbered ``version_N`` *that
    has one*: a run that crashed before saving (its folder, no ``last``) does not make the next
    run start from scratch."""

    class Crash(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise RuntimeError("crashed before the first checkpoint")

    _trainer(tmp_path, max_epochs=2, log_every_n_steps=1).fit(Regressor(), loader(8))  # version_0: 4 steps
    with pytest.raises(RuntimeError, match="crashed before the first checkpoint"):
        _trainer(tmp_path, max_epochs=3, log_every_n_steps=1).fit(Crash(), loader(8), ckpt_path="last")
    assert (tmp_path / "torchrig_logs" / "version_1").is_dir() and not _last(tmp_path, 1).exists()
    capsys.readouterr()
    third = _trainer(tmp_path, max_epochs=3, log_every_n_steps=1)
    third.fit(Regressor(), loader(8), ckpt_path="last")
    assert f"torchrig: resumed from {_last(tmp_path, 0)} -> " in capsys.readouterr().out
    assert third.global_step == 6 and _last(tmp_path, 2).resolve().name.endswith("-step=6")


@pytest.mark.timeout(30)
def test_last_with_no_earlier_run_warns_and_starts_fresh(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_epochs=1, log_every_n_steps=1)
    with pytest.warns(UserWarning, match=r"ckpt_path='last': there is no checkpoint at .*version_0.checkpoints.last"):
        trainer.fit(Regressor(), loader(8), ckpt_path="last")
    assert trainer.global_step == 2


class _Silent(Regressor):
    """Logs nothing: no step value can be lost."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


@pytest.mark.timeout(30)
def test_a_fit_shorter_than_log_every_n_steps_warns(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_epochs=4, accumulate_grad_batches=2)  # log_every_n_steps=50
    with pytest.warns(UserWarning) as got:
        trainer.fit(Regressor(), loader(24))  # 6 batches: 3 optimizer steps an epoch, 12 in all
    warned = [w for w in got if "log_every_n_steps" in str(w.message)]
    assert [str(w.message) for w in warned] == [
        "this fit ran 12 optimizer steps, fewer than Trainer(log_every_n_steps=50): the values logged per step "
        "(train_loss) never reached the loggers; set log_every_n_steps=12 or lower, or log with on_epoch=True"
    ]
    assert warned[0].filename == __file__  # the user's trainer.fit line, not torchrig's
    assert not (tmp_path / "torchrig_logs" / "version_0" / "metrics.csv").exists()  # nothing was logged
    with pytest.warns(UserWarning, match=r"this fit ran 7 optimizer steps, fewer than Trainer\(log_every_n_steps=50\)"):
        _trainer(tmp_path, max_steps=7).fit(Regressor(), loader(24))  # max_epochs unset: max_steps counts
    quiet: list[tuple[dict[str, Any], type[Regressor]]] = [
        ({"log_every_n_steps": 12}, Regressor),  # 12 steps log once
        ({"logger": False}, Regressor),  # nothing to log to
        ({"max_epochs": 17}, Regressor),  # 51 steps log once
        ({}, _Silent),  # the module logs nothing
        ({"max_steps": 0}, Regressor),  # nothing trained: log_every_n_steps=0 is no advice
    ]
    for kwargs, module in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _trainer(tmp_path, **{"max_epochs": 4, "accumulate_grad_batches": 2, **kwargs}).fit(module(), loader(24))


DDP_SCRIPT = r"""
import sys
import torchrig
from trainer_helpers import Regressor, loader, subprocess_env

trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=int(sys.argv[2]), enable_progress_bar=False,
    default_root_dir=sys.argv[1], log_every_n_steps=1,
)
trainer.fit(Regressor(), loader(16), ckpt_path="last")
# One write per line: unbuffered print writes each piece apart, and the two ranks share the pipe.
line = f"rank {trainer.rig.global_rank} dir {trainer.checkpoint_callback.resolve_dirpath(trainer)} step "
sys.stdout.write(line + f"{trainer.global_step}\n")
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_two_processes_agree_on_the_run_folder_and_resume_the_newest_run(tmp_path: Path) -> None:
    # Only rank zero's logger picks version_N; the other rank takes its choice (no stray folder).
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    root = tmp_path / "root"
    for epochs in (1, 2):
        done = subprocess.run(
            [sys.executable, str(script), str(root), str(epochs)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert done.returncode == 0, done.stderr
    # Found, not split into lines: the two ranks print at once, unbuffered (see conftest.printed_json).
    lines = sorted(re.findall(r"rank \d dir \S+ step \d+", done.stdout))
    checkpoints = root / "torchrig_logs" / "version_1" / "checkpoints"
    assert lines == [f"rank {r} dir {checkpoints} step 4" for r in (0, 1)]  # 2 steps an epoch on 2 processes
    assert f"torchrig: resumed from {_last(root, 0)} -> " in done.stdout
    assert sorted(p.name for p in (root / "torchrig_logs").iterdir()) == ["version_0", "version_1"]
    assert _last(root, 1).resolve().name.endswith("-step=4")


@pytest.mark.timeout(30)
def test_a_run_directory_with_a_file_in_its_way_is_refused_before_training(tmp_path: Path) -> None:
    """Not at the end of the fit, when the first checkpoint or metrics row is written."""
    blocking = tmp_path / "a file"
    blocking.write_text("the user's")
    refused = rf"must be a directory, but {re.escape(str(blocking))} exists and is not one; pass a folder, or a path"
    for root in (blocking, blocking / "below"):
        with pytest.raises(ValueError, match=rf"^default_root_dir='{re.escape(str(root))}' {refused}"):
            _trainer(root)
        with pytest.raises(ValueError, match=rf"^root_dir='{re.escape(str(root))}' {refused}"):
            torchrig.CSVLogger(root_dir=root)
        with pytest.raises(ValueError, match=rf"^dirpath='{re.escape(str(root))}' {refused}"):
            torchrig.ModelCheckpoint(dirpath=root)
    assert blocking.read_text() == "the user's"


def test_a_file_put_in_the_way_after_the_start_is_named_when_the_run_directory_is_made(tmp_path: Path) -> None:
    from torchrig.trainer.loggers import next_version_dir

    blocking = tmp_path / "runs"
    blocking.write_text("the user's")
    with pytest.raises(ValueError, match=rf"cannot make the run directory .*: {re.escape(str(blocking))} exists and"):
        next_version_dir(blocking / "x")
    assert blocking.read_text() == "the user's"
