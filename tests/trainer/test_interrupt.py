"""Ctrl-C during ``Trainer.fit`` (issue 15, item 14): the fit stops at the next optimizer step,
saves ``last`` there, and raises ``KeyboardInterrupt`` (the script exits non-zero); resuming
from that checkpoint ends with the weights of a run that was never interrupted."""

from __future__ import annotations

import os
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

root, interrupt = sys.argv[1], sys.argv[2] == "1"


class CtrlC(torchrig.Callback):
    # Epoch 1, third batch: between the two micro-batches of step 5 (accumulating 2 batches).
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if interrupt and (trainer.current_epoch, batch_idx) == (1, 2):
            os.kill(os.getpid(), signal.SIGINT)  # what a Ctrl-C in the terminal sends


torch.manual_seed(0)
module = Regressor(dropout=0.25)  # dropout: the RNG stream must continue exactly too
trainer = torchrig.Trainer(  # the Trainer's default checkpointing: no save between epochs here
    accelerator="cpu", devices=1, max_epochs=3, seed=123, accumulate_grad_batches=2,
    enable_progress_bar=False, logger=False, default_root_dir=root, callbacks=[CtrlC()],
)
trainer.fit(module, loader(24, batch_size=4, shuffle=True), loader(8), ckpt_path="last")
torch.save(module.state_dict(), os.path.join(root, "final.pt"))
print("done at step", trainer.global_step)
"""


def _run(tmp: Path, root: str, interrupt: bool) -> subprocess.CompletedProcess[str]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp / root), "1" if interrupt else "0"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow  # three interpreters in turn, each importing torch: 10.6 s of CPU in them, 20 s of wall idle
@pytest.mark.timeout(120)
def test_ctrl_c_saves_last_at_the_next_step_exits_non_zero_and_resumes_exactly(tmp_path: Path) -> None:
    clean = _run(tmp_path, "clean", interrupt=False)
    assert clean.returncode == 0, clean.stderr
    assert "done at step 9" in clean.stdout  # 3 epochs of 6 batches, a step every 2
    stopped = _run(tmp_path, "stopped", interrupt=True)
    # Python exits an uncaught KeyboardInterrupt by SIGINT (-2; 130 from a shell), but with 1 once
    # torch._dynamo is imported on torch 2.11 (seen with `python -c "import torch._dynamo; raise
    # KeyboardInterrupt"` on the GPU machine): what counts is non-zero and the KeyboardInterrupt.
    assert stopped.returncode in (130, -signal.SIGINT, 1), stopped.stderr
    assert "KeyboardInterrupt" in stopped.stderr and "done at step" not in stopped.stdout
    said = "torchrig: SIGINT: stopping at the next optimizer step to save it; Ctrl-C again stops at once"
    assert said in stopped.stderr
    # Not after the micro-batch the Ctrl-C came in, but at the optimizer step after it.
    last = (tmp_path / "stopped" / "checkpoints" / "last").resolve()
    assert last.name == "epoch=1-step=5"
    assert f"torchrig: SIGINT: stopped the run; saved step 5 as {last}" in stopped.stdout
    resumed = _run(tmp_path, "stopped", interrupt=False)
    assert resumed.returncode == 0, resumed.stderr
    link = tmp_path / "stopped" / "checkpoints" / "last"
    said = f"torchrig: resumed from {link} -> {last.name}: continues in epoch 1/2 after 4 batches, step 5"
    assert said in resumed.stdout
    assert "done at step 9" in resumed.stdout
    a = torch.load(tmp_path / "clean" / "final.pt")
    b = torch.load(tmp_path / "stopped" / "final.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise


class CtrlC(torchrig.Callback):
    """Sends this process ``times`` SIGINTs after the optimizer step ``at_step``."""

    def __init__(self, at_step: int, times: int) -> None:
        self.at_step, self.times = at_step, times

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at_step:
            self.at_step = -1
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(30)
def test_a_ctrl_c_in_process_saves_that_step_and_a_second_one_stops_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    once = quiet_trainer(tmp_path / "once", max_epochs=2, enable_checkpointing=True, callbacks=[CtrlC(3, 1)])
    with pytest.raises(KeyboardInterrupt):
        once.fit(Regressor(), loader(40))
    last = (tmp_path / "once" / "checkpoints" / "last").resolve()
    assert last.name == "epoch=0-step=3" and once.interrupted and once.global_step == 3
    assert f"torchrig: SIGINT: stopped the run; saved step 3 as {last}" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back after the fit
    # The second Ctrl-C raises where it lands (here, inside the callback): nothing is saved.
    twice = quiet_trainer(tmp_path / "twice", max_epochs=2, enable_checkpointing=True, callbacks=[CtrlC(3, 2)])
    with pytest.raises(KeyboardInterrupt):
        twice.fit(Regressor(), loader(40))
    assert "KeyboardInterrupt: stopped the run; saved nothing now" in capsys.readouterr().out
    assert not (tmp_path / "twice" / "checkpoints").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class InterruptedValidation(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        raise KeyboardInterrupt


@pytest.mark.timeout(30)
def test_a_keyboard_interrupt_in_validate_is_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KeyboardInterrupt):
        quiet_trainer(tmp_path).validate(InterruptedValidation(), loader(8))
    assert "KeyboardInterrupt: stopped the run; saved nothing now" in capsys.readouterr().out
