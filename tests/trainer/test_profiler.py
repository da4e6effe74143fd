"""Trainer(profiler=...): the simple profiler's phase table, the PyTorch profiler's traces, the
argument's checks, and no profiling work at all when it is off."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig.trainer.profiler import PHASES, Profiler, PyTorchProfiler, SimpleProfiler


class Heavy(torchrig.TrainingModule):
    """Steps of several milliseconds (a sleep in each: matmuls alone took about 1 ms, and on a
    loaded machine the loop's bookkeeping then reached 10% of the wall time), so the loop's own
    bookkeeping is a small share however busy the machine is."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(0.005)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        time.sleep(0.005)
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def heavy_loader(batches: int = 6) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(batches * 64, 256, generator=g), torch.randn(batches * 64, 1)), 64)


def test_simple_profiler_phases_add_up_to_the_measured_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=3,
        profiler="simple",
        log_every_n_steps=1,
        logger=True,
        enable_checkpointing=True,
        enable_model_summary=False,
    )
    trainer.fit(Heavy(), heavy_loader(), heavy_loader(2))
    profiler = trainer.profiler
    assert isinstance(profiler, SimpleProfiler)
    assert profiler.steps == 18
    phases = profiler.phase_seconds
    assert list(phases) == [*PHASES, "other"]
    # Every phase the fit has was timed: the data, the step's parts, the logging, validation,
    # the callbacks' hooks (the checkpoint callback's epoch ends count as checkpointing).
    for phase in ("data loading", "training_step (forward)", "backward", "optimizer step", "logging", "validation"):
        assert phases[phase] > 0, phase
    assert phases["checkpointing"] > 0
    # The timed phases cover the wall time from the first step's start to the last epoch's end,
    # less the loop's own bookkeeping: most of it (a phase left untimed, such as validation, would
    # leave a third of it in "other").
    timed = sum(v for k, v in phases.items() if k != "other")
    assert timed <= profiler.total_seconds
    assert timed >= 0.9 * profiler.total_seconds, phases
    assert sum(phases.values()) == pytest.approx(profiler.total_seconds)
    out = capsys.readouterr().out
    assert "SimpleProfiler: 18 steps in" in out
    for phase in (*PHASES, "other", "total"):
        assert f"│ {phase} " in out, phase
    assert "Slowest hooks" in out and "ModelCheckpoint.on_train_epoch_end" in out
    assert "ModelCheckpoint.on_train_epoch_end" in profiler.hook_seconds


def test_simple_profiler_nested_phases_count_once(tmp_path: Path) -> None:
    # Validation runs the callbacks' eval hooks: their time is the callbacks', not validation's too.
    class Slow(torchrig.Callback):
        def on_eval_batch_end(self, *args: Any) -> None:
            x = torch.randn(200, 200)
            for _ in range(5):
                x = x @ x / 200

    trainer = quiet_trainer(tmp_path, max_epochs=1, profiler="simple", callbacks=[Slow()], enable_model_summary=False)
    trainer.fit(Regressor(), loader(), loader())
    profiler = trainer.profiler
    assert isinstance(profiler, SimpleProfiler)
    seconds, calls = profiler.hook_seconds["Slow.on_eval_batch_end"]
    assert calls == 8
    assert profiler.phase_seconds["callbacks"] >= seconds
    assert sum(profiler.phase_seconds.values()) == pytest.approx(profiler.total_seconds)
    assert next(iter(profiler.hook_seconds)) == "Slow.on_eval_batch_end"  # the slowest first


def test_pytorch_profiler_writes_traces_and_prints_the_top_operators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = PyTorchProfiler(wait=1, warmup=1, active=2, row_limit=40)
    trainer = quiet_trainer(
        tmp_path, max_epochs=1, profiler=profiler, logger=True, enable_model_summary=False, log_every_n_steps=1
    )
    trainer.fit(Regressor(), loader())  # 8 steps: one window (steps 3 and 4 recorded)
    run_dir = trainer.log_dir
    assert profiler.output_dir == run_dir / "profiler" and run_dir != tmp_path
    chrome = run_dir / "profiler" / "chrome_trace_rank0.json"
    assert profiler.chrome_traces == [chrome]
    events = json.loads(chrome.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"training_step (forward)", "backward", "optimizer step", "data loading"} <= names
    assert sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")) == 2  # active=2
    board = list((run_dir / "profiler" / "tensorboard").glob("rank0.*.pt.trace.json"))
    assert len(board) == 1 and json.loads(board[0].read_text())["traceEvents"]
    out = capsys.readouterr().out
    assert f"PyTorchProfiler: top 40 operators by self time (traces in {run_dir / 'profiler'}):" in out
    assert "Self CPU %" in out and "aten::addmm" in out


def test_pytorch_profiler_says_when_the_fit_is_shorter_than_its_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = PyTorchProfiler(wait=7, warmup=1, active=3, dirpath=tmp_path / "prof")  # in warmup at the end
    trainer = quiet_trainer(tmp_path, max_epochs=1, profiler=profiler, enable_model_summary=False)
    trainer.fit(Regressor(), loader())
    assert "PyTorchProfiler: recorded nothing: the fit ran 8 steps, the schedule needs 11" in capsys.readouterr().out
    assert profiler.chrome_traces == []


@pytest.mark.parametrize("value", ["fancy", 3, True, object()])
def test_profiler_argument_is_checked(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"profiler=.*: use None, 'simple', 'pytorch' or a torchrig.Profiler object"):
        quiet_trainer(tmp_path, profiler=value)


def test_profiler_argument_by_name_and_object(tmp_path: Path) -> None:
    assert quiet_trainer(tmp_path).profiler is None
    assert isinstance(quiet_trainer(tmp_path, profiler="simple").profiler, SimpleProfiler)
    assert isinstance(quiet_trainer(tmp_path, profiler="pytorch").profiler, PyTorchProfiler)
    mine = SimpleProfiler(sync_device=False)
    assert quiet_trainer(tmp_path, profiler=mine).profiler is mine
    with pytest.raises(ValueError, match="active=0"):
        PyTorchProfiler(active=0)
    with pytest.raises(ValueError, match="sync_device='yes'"):
        SimpleProfiler(sync_device="yes")  # type: ignore[arg-type]


def test_without_a_profiler_the_loop_calls_no_wrapper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # profiler=None: nothing of the profiler runs in a fit (the loop's callables are its own).
    called: list[str] = []
    for name in ("start", "stop", "wrap", "wrap_batches", "wrap_hooks"):
        monkeypatch.setattr(Profiler, name, lambda *a, _n=name: called.append(_n))
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_model_summary=False)
    trainer.fit(Regressor(), loader(), loader())
    assert called == []
    runner = trainer.run.batch_runner()
    assert runner.__closure__ is not None
    cells = [c.cell_contents for c in runner.__closure__]
    assert trainer.run.log_step in cells and trainer.run.clip_gradients in cells  # not wrapped


def test_a_custom_profiler_sees_every_phase(tmp_path: Path) -> None:
    class Counting(Profiler):
        def __init__(self) -> None:
            self.phases: dict[str, int] = {}
            self.events: list[str] = []

        def start(self, trainer: Any) -> None:
            self.events.append("start")

        def stop(self, trainer: Any) -> None:
            self.events.append("stop")

        def wrap(self, phase: str, fn: Any, name: str | None = None) -> Any:
            def counted(*args: Any) -> Any:
                self.phases[phase] = self.phases.get(phase, 0) + 1
                return fn(*args)

            return counted

    profiler = Counting()
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=2,
        profiler=profiler,
        gradient_clip_val=1.0,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(Regressor(), loader(), loader())
    assert profiler.events == ["start", "stop"]
    assert profiler.phases["training_step (forward)"] == 16 and profiler.phases["backward"] == 16
    assert profiler.phases["optimizer step"] == 16 * 3  # clip, step, zero_grad
    assert profiler.phases["logging"] == 16 and profiler.phases["validation"] == 2


@pytest.mark.timeout(60)
def test_the_cli_reaches_the_profiler_and_the_summary_switch(tmp_path: Path) -> None:
    from cli_script import Line
    from cli_script import Regressor as CliRegressor

    from torchrig.trainer.cli import CLI

    common = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = CLI(
        CliRegressor,
        Line,
        args=["--trainer.profiler=simple", "--trainer.enable_model_summary=false", *common],
        run=False,
    )
    assert isinstance(cli.trainer.profiler, SimpleProfiler) and cli.trainer.enable_model_summary is False
    args = ["--trainer.profiler=PyTorchProfiler", "--trainer.profiler.active=2", "--trainer.profiler.wait=0", *common]
    cli = CLI(CliRegressor, Line, args=args, run=False)
    assert isinstance(cli.trainer.profiler, PyTorchProfiler)
    assert (cli.trainer.profiler.wait, cli.trainer.profiler.warmup, cli.trainer.profiler.active) == (0, 1, 2)
    assert CLI(CliRegressor, Line, args=common, run=False).trainer.enable_model_summary is True


def test_the_cli_refuses_an_unknown_profiler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli_script import Line
    from cli_script import Regressor as CliRegressor

    from torchrig.trainer.cli import CLI

    with pytest.raises(SystemExit) as exit_info:
        CLI(CliRegressor, Line, args=["--trainer.profiler=fancy", f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert exit_info.value.code == 2
    assert "error: ValueError: profiler='fancy': use None, 'simple', 'pytorch'" in capsys.readouterr().err


def test_a_fit_that_raises_still_stops_the_profiler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Boom(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 5:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    profiler = PyTorchProfiler(wait=0, warmup=1, active=2, dirpath=tmp_path / "prof")
    trainer = quiet_trainer(tmp_path, max_epochs=1, profiler=profiler, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), loader())
    assert not torch._C._autograd._profiler_enabled()  # not left running after the fit
    assert profiler.chrome_traces == [tmp_path / "prof" / "chrome_trace_rank0.json"]  # the window before the error
    simple = quiet_trainer(tmp_path, max_epochs=1, profiler="simple", enable_model_summary=False)
    with pytest.raises(RuntimeError, match="boom"):
        simple.fit(Boom(), loader())
    assert "SimpleProfiler: 5 steps in" in capsys.readouterr().out


DDP_SCRIPT = r"""
import sys
import torchrig
from trainer_helpers import Regressor, loader

profiler = torchrig.PyTorchProfiler(wait=0, warmup=1, active=2)
trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, enable_progress_bar=False,
    enable_checkpointing=False, default_root_dir=sys.argv[1], profiler=profiler, log_every_n_steps=1,
)
trainer.fit(Regressor(), loader(16, batch_size=2))
simple = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, enable_progress_bar=False, logger=False,
    enable_checkpointing=False, default_root_dir=sys.argv[1], profiler="simple", enable_model_summary=False,
)
simple.fit(Regressor(), loader(16, batch_size=2))
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_profilers_on_two_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from trainer_helpers import subprocess_env

    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Both ranks write into rank zero's run directory; rank zero prints.
    profiler_dir = tmp_path / "torchrig_logs" / "version_0" / "profiler"
    assert sorted(p.name for p in profiler_dir.glob("chrome_trace_rank*.json")) == [
        "chrome_trace_rank0.json",
        "chrome_trace_rank1.json",
    ]
    assert len(list((profiler_dir / "tensorboard").glob("rank*.pt.trace.json"))) == 2
    assert sorted(p.name for p in (tmp_path / "torchrig_logs").iterdir()) == ["version_0"]
    assert done.stdout.count("PyTorchProfiler: top 15 operators") == 1
    assert done.stdout.count("SimpleProfiler: 4 steps in") == 1
