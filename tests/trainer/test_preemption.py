"""Preemption in one process: which signals are watched, what a stop signal does to a fit, the
exit status, ``rig.preempted()``, and automatic resume of a restarted job."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer

import torchrig
from conftest import python_env
from torchrig.preemption import resolve_requeue_signal, resolve_signals, stopped_for_signal


def test_signal_lists_are_resolved_and_bad_ones_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert resolve_signals("auto") == (signal.SIGTERM, signal.SIGINT)
    assert resolve_requeue_signal("auto") is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert resolve_signals("auto") == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    assert resolve_requeue_signal("auto") == signal.SIGUSR1
    assert resolve_signals(["TERM", "sigusr2", 15, signal.SIGHUP]) == (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)
    assert resolve_signals(None) == () and resolve_signals([]) == ()
    with pytest.raises(ValueError, match=r"stop_signals='SIGBOGUS' is not a signal; give names such as 'SIGTERM'"):
        resolve_signals("SIGBOGUS")
    with pytest.raises(ValueError, match=r"stop_signals=9: SIGKILL cannot be caught, so no process can save on it"):
        resolve_signals([9])
    with pytest.raises(ValueError, match=r"stop_signals=True is not a signal"):
        resolve_signals([True])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"requeue_signal='KILL': SIGKILL cannot be caught"):
        torchrig.Trainer(accelerator="cpu", requeue_signal="KILL", logger=False)
    with pytest.raises(ValueError, match=r"auto_resume='yes' must be True or False"):
        torchrig.Trainer(accelerator="cpu", auto_resume="yes", logger=False)  # type: ignore[arg-type]
    trainer = torchrig.Trainer(accelerator="cpu", stop_signals=["SIGTERM"], requeue_signal="SIGUSR2", logger=False)
    assert trainer.stop_signals == (signal.SIGTERM, signal.SIGUSR2)  # the requeue signal is watched too


def test_preempted_exit_status_and_which_statuses_mean_stopped_for_a_signal() -> None:
    stop = torchrig.Preempted(signal.SIGTERM)
    assert isinstance(stop, SystemExit) and stop.code == 143 and str(stop) == "stopped by SIGTERM (exit status 143)"
    assert torchrig.Preempted(signal.SIGUSR1).code == 138
    requeued = torchrig.Preempted(signal.SIGUSR1, requeued=True)
    assert requeued.code == 0 and str(requeued) == "stopped by SIGUSR1 (requeued)"
    assert stopped_for_signal(143) and stopped_for_signal(-signal.SIGINT) and stopped_for_signal(130)
    assert not stopped_for_signal(0) and not stopped_for_signal(1) and not stopped_for_signal(-9)


class SendAt(torchrig.Callback):
    """Sends this process ``sig`` after optimizer step ``step``; records the handler it found."""

    def __init__(self, step: int, sig: int | None) -> None:
        self.step, self.sig = step, sig
        self.handlers: list[Any] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.handlers.append(signal.getsignal(signal.SIGTERM))
        if trainer.global_step == self.step and self.sig is not None:
            self.step = -1
            os.kill(os.getpid(), self.sig)


@pytest.mark.timeout(60)
def test_sigterm_stops_the_fit_at_that_step_saves_last_and_exits_143(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[SendAt(4, signal.SIGTERM)])
    with pytest.raises(torchrig.Preempted) as info:
        trainer.fit(Regressor(), loader(40))
    assert info.value.code == 143 and info.value.signum == signal.SIGTERM and not info.value.requeued
    last = (tmp_path / "checkpoints" / "last").resolve()
    assert last.name == "epoch=0-step=4" and info.value.saved == str(last)
    assert trainer.interrupted and trainer.global_step == 4
    out, err = capfd.readouterr()
    assert "torchrig: SIGTERM: stopping at the next optimizer step to save it" in err
    assert f"torchrig: SIGTERM: stopped the run; saved step 4 as {last}" in out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back after the fit
    # Resumed, it ends where a fit never stopped ends.
    torch.manual_seed(0)
    resumed_module = Regressor()
    quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True).fit(resumed_module, loader(40), ckpt_path="last")
    torch.manual_seed(0)
    clean_module = Regressor()
    quiet_trainer(tmp_path / "clean", max_epochs=3).fit(clean_module, loader(40))
    assert all(torch.equal(a, b) for a, b in zip(params(resumed_module), params(clean_module), strict=True))


# A fit that gets SIGTERM after step 4, and SIGTERM again while it saves that step (in its own
# process: were the second one not ignored, it would kill the process that got it).
TERM_TWICE = r"""
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import torchrig
from trainer_helpers import Regressor, loader, quiet_trainer

class TermTwice(torchrig.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 4 and not trainer.interrupted:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if trainer.interrupted:
            os.kill(os.getpid(), signal.SIGTERM)
            print("sent SIGTERM again during the save", flush=True)

quiet_trainer(Path(sys.argv[1]), max_epochs=3, enable_checkpointing=True, callbacks=[TermTwice()]).fit(
    Regressor(), loader(40)
)
"""


@pytest.mark.timeout(60)
def test_a_second_sigterm_while_the_stop_is_saved_does_not_cut_the_save_short(tmp_path: Path) -> None:
    """docs/distributed.md: "A repeated SIGTERM while the run saves is ignored"."""
    script = tmp_path / "term_twice.py"
    script.write_text(TERM_TWICE)
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), here], capture_output=True, text=True, timeout=50, env=python_env()
    )
    assert done.returncode == 143, done.stderr[-3000:]
    assert "sent SIGTERM again during the save" in done.stdout, done.stdout
    last = (tmp_path / "checkpoints" / "last").resolve()
    assert last.name == "epoch=0-step=4" and f"saved step 4 as {last}" in done.stdout, done.stdout
    assert torchrig.checkpoint.read_values(last)["step"] == 4
    assert done.stderr.count("SIGTERM: stopping at the next optimizer step") == 1  # noted once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scontrol", ["fails", "missing"])
def test_a_requeue_that_fails_says_why_and_exits_with_128_plus_the_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], scontrol: str
) -> None:
    """docs/distributed.md: "If ``scontrol`` fails, the message says why and the exit status is
    128 + the signal" (the checkpoint of the signal is saved all the same)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if scontrol == "fails":
        fake = bin_dir / "scontrol"
        fake.write_text(
            "#!/bin/sh\necho 'slurm_requeue error: Requested operation is presently disabled' >&2\nexit 1\n"
        )
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    else:
        monkeypatch.setenv("PATH", str(bin_dir))  # no scontrol anywhere
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    trainer = quiet_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[SendAt(4, signal.SIGUSR1)])
    assert trainer.requeue_signal == signal.SIGUSR1  # "auto" under SLURM
    with pytest.raises(torchrig.Preempted) as info:
        trainer.fit(Regressor(), loader(40))
    assert info.value.code == 138 and not info.value.requeued
    assert (tmp_path / "checkpoints" / "last").resolve().name == "epoch=0-step=4"
    out, err = capfd.readouterr()
    why = (
        "`scontrol requeue 4242` exited with 1: slurm_requeue error: Requested operation is presently disabled"
        if scontrol == "fails"
        else "scontrol is not on PATH"
    )
    assert f"torchrig: could not requeue the job: {why}" in err, err
    assert "saved step 4 as" in out and "requeued the job" not in out


@pytest.mark.timeout(60)
def test_signals_not_asked_for_and_handlers_of_the_program_are_left_alone(tmp_path: Path) -> None:
    off = SendAt(2, None)
    quiet_trainer(tmp_path / "off", max_epochs=1, stop_signals=None, callbacks=[off]).fit(Regressor(), loader(16))
    assert off.handlers and all(h is signal.SIG_DFL for h in off.handlers)
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    try:
        own = SendAt(2, signal.SIGTERM)
        trainer = quiet_trainer(tmp_path / "own", max_epochs=1, callbacks=[own])
        trainer.fit(Regressor(), loader(16))  # the program's handler runs; the fit goes on
        assert caught == [signal.SIGTERM] and trainer.global_step == 4 and not trainer.interrupted
        assert all(h is own.handlers[0] and h is not signal.SIG_DFL for h in own.handlers)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.timeout(30)
def test_rig_preempted_reports_the_signal_once_watched(tmp_path: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    assert rig.preempted() is None
    try:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # watched from the first call
        os.kill(os.getpid(), signal.SIGTERM)
        assert rig.preempted() is signal.SIGTERM
        assert rig.preempted() is signal.SIGTERM
    finally:
        assert rig._signal_watch is not None
        rig._signal_watch.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(ValueError, match=r"signals='SIGNOPE' is not a signal"):
        torchrig.Rig(accelerator="cpu").preempted("SIGNOPE")


@pytest.mark.timeout(60)
def test_a_restarted_job_resumes_from_last_by_itself_unless_switched_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True).fit(Regressor(), loader(16))
    assert "restart 1 of this job: no checkpoint at" in capsys.readouterr().out  # the first attempt saved nothing
    early = tmp_path / "early"
    shutil.copytree((tmp_path / "checkpoints" / "last").resolve(), early)  # step 4, for the explicit ckpt_path below
    resumed = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True)
    resumed.fit(Regressor(), loader(16))
    out = capsys.readouterr().out
    link = tmp_path / "checkpoints" / "last"
    assert f"torchrig: restart 1 of this job: resuming from {link} (auto_resume=False turns this off)" in out
    assert "continues with epoch 1/1, step 4" in out and resumed.global_step == 8
    fresh = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, auto_resume=False)
    fresh.fit(Regressor(), loader(16))
    assert "resum" not in capsys.readouterr().out and fresh.global_step == 4
    explicit = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True)
    explicit.fit(Regressor(), loader(16), ckpt_path=early)  # an explicit ckpt_path always wins
    out = capsys.readouterr().out
    assert f"torchrig: resumed from {early}: continues with epoch 1/1, step 4" in out, out
    assert "restart 1 of this job" not in out and explicit.global_step == 8
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True).fit(Regressor(), loader(16))
    assert "resum" not in capsys.readouterr().out  # a first run never resumes by itself


class _Done:
    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("interval", ["0", "1"])
def test_several_ranks_check_at_polls_they_agree_on_and_stop_at_the_second_check_after_a_signal(
    monkeypatch: pytest.MonkeyPatch, interval: str
) -> None:
    """The schedule of checks, with a fake all-reduce (this rank's values are the maximum) and
    a fake clock (10 ms per poll): every poll at interval 0; with 1 s, about every 100 polls,
    reached by doubling."""
    import torchrig.preemption as preemption

    monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", interval)
    clock = [0.0]
    monkeypatch.setattr(preemption.time, "perf_counter", lambda: clock[0])
    checks: list[int] = []
    watch = preemption.SignalWatch(type("S", (), {"world_size": 2, "global_rank": 1})(), [signal.SIGTERM])

    def all_reduce(flag: torch.Tensor, **kwargs: Any) -> _Done:
        checks.append(watch._calls)
        return _Done()

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(preemption, "control_group", lambda: None)
    assert watch.poll() == 0  # a first poll at once (as between two epochs): no rate to go by yet
    for _ in range(499):
        clock[0] += 0.01
        assert watch.poll() == 0
    if interval == "0":
        assert checks == list(range(1, 501))
    else:
        gaps = [b - a for a, b in itertools.pairwise(checks)]
        # Doubling at most per check up to the 100 polls that take 1 s, then about 100.
        assert gaps[:7] == [1, 2, 4, 8, 16, 32, 64] and all(95 <= g <= 105 for g in gaps[7:]), gaps
    watch.received = signal.SIGTERM  # what the handler notes
    polls = 0
    while not watch.poll():
        polls += 1
        clock[0] += 0.01
    assert len([c for c in checks if c > 500]) == 1  # the check that sends it; the next one reads it
    assert polls <= (1 if interval == "0" else 210)
    assert watch.settle() == signal.SIGTERM
    with pytest.raises(ValueError, match=r"TORCHRIG_SIGNAL_CHECK_INTERVAL='soon' must be seconds >= 0"):
        monkeypatch.setenv("TORCHRIG_SIGNAL_CHECK_INTERVAL", "soon")
        preemption.check_interval()


LATE_SIGNAL_SCRIPT = r"""
import os, signal, sys, time
import torchrig
from trainer_helpers import Regressor, loader, quiet_trainer

root = sys.argv[1]
trainer = quiet_trainer(root, max_steps=2, stop_signals=["SIGTERM", "SIGUSR1"], enable_model_summary=False)
trainer.fit(Regressor(), loader(8))
print("fit returned", flush=True)
os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning, after training: the results are kept
time.sleep(0.2)
print("work after the fit goes on", trainer.global_step, flush=True)

seen = []
class Look(torchrig.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        seen.append(signal.getsignal(signal.SIGUSR1))

again = quiet_trainer(root, max_steps=1, stop_signals=["SIGUSR1"], callbacks=[Look()], enable_model_summary=False)
again.fit(Regressor(), loader(8))
print("a second fit watches it again:", getattr(seen[0], "__name__", None), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # not a warning: its default action is back, it ends the process
time.sleep(10)
print("not reached", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_warning_signal_after_fit_returned_is_said_and_ignored_and_sigterm_still_ends_the_process(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from trainer_helpers import subprocess_env

    script = tmp_path / "late.py"
    script.write_text(LATE_SIGNAL_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=subprocess_env(), capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    assert lines[-3:] == ["fit returned", "work after the fit goes on 2", "a second fit watches it again: _handle"]
    said = (
        "torchrig: SIGUSR1 came after fit() returned: the training and its checkpoints are done, so it is ignored "
        "(signal.signal(signal.SIGUSR1, handler) to act on it yourself)"
    )
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
