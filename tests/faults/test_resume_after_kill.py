"""Fault injection: SIGKILL a training process at random steps and in the middle of saves,
resume it from its last checkpoint, and require weights bitwise equal to an uninterrupted run.

The training processes are forked from this one (torch is already imported here), so each
start costs milliseconds instead of an interpreter start; they are killed with SIGKILL.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch._inductor  # (use_deterministic_algorithms imports it: pay once, before forking)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

_spec = importlib.util.spec_from_file_location("train_script", Path(__file__).with_name("train_script.py"))
assert _spec is not None and _spec.loader is not None
train_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_script)

STEPS, SAVE_EVERY = 30, 4


def run(args: list[str], kill_when: Callable[[str], bool] | None = None) -> list[str]:
    """Fork a training process; SIGKILL it at the first line ``kill_when`` accepts. Returns its lines."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: train, report lines through the pipe, never return into pytest
        code = 0
        try:
            os.close(read_fd)
            train_script.main(args, lambda line: os.write(write_fd, (line + "\n").encode()))
        except BaseException as err:
            os.write(write_fd, f"error {type(err).__name__}: {err}\n".encode())
            code = 1
        os._exit(code)
    os.close(write_fd)
    lines: list[str] = []
    killed = False
    with os.fdopen(read_fd) as pipe:
        for line in pipe:
            lines.append(line.strip())
            if kill_when is not None and not killed and kill_when(lines[-1]):
                os.kill(pid, signal.SIGKILL)
                killed = True
    _, status = os.waitpid(pid, 0)
    if kill_when is not None:
        assert killed, f"the kill point never came; the run printed {lines[-5:]}"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    else:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, lines[-5:]
    return lines


def weights(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


@pytest.mark.timeout(60)
def test_killed_runs_resume_bit_exact(tmp_path: Path) -> None:
    common = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    run(["--ckpt", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.safetensors"), *common])
    reference = weights(tmp_path / "ref.safetensors")

    rng = random.Random(os.environ.get("TORCHRIG_FAULT_SEED", "5"))
    mid_epoch = rng.choice([s for s in range(SAVE_EVERY + 1, STEPS) if s % SAVE_EVERY and s % 6])
    on_boundary = rng.choice([s for s in range(SAVE_EVERY + 1, STEPS) if s % 6 == 0 and s % SAVE_EVERY])
    save_no = rng.randrange(2, STEPS // SAVE_EVERY)
    scenarios: dict[str, tuple[list[str], Callable[[str], bool]]] = {
        f"after step {mid_epoch}": ([], lambda line: line == f"step {mid_epoch}"),
        f"after step {on_boundary} (epoch end)": ([], lambda line: line == f"step {on_boundary}"),
        f"writing a file of save {save_no}": (
            ["--pause-in-save", "0.05"],
            _nth(save_no, lambda line: line.startswith("in-save write state.pt")),
        ),
        f"renaming save {save_no + 1} into place": (
            ["--pause-in-save", "0.05"],
            _nth(save_no + 1, lambda line: line.startswith("in-save commit")),
        ),
    }
    for i, (what, (extra, kill_when)) in enumerate(scenarios.items()):
        ckpt, out = tmp_path / f"run{i}", tmp_path / f"run{i}.safetensors"
        killed = run(["--ckpt", str(ckpt), "--out", str(out), *common, *extra], kill_when)
        resumed = run(["--ckpt", str(ckpt), "--out", str(out), *common])
        last_saved = max([int(x.split()[1]) for x in killed if x.startswith("saved ")], default=0)
        assert resumed[0] == f"resumed {last_saved}", (what, resumed[:2])
        assert resumed[1] == f"step {last_saved + 1}", (what, resumed[:2])
        final = weights(out)
        assert final.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(final[name], tensor), f"killed {what}: {name} differs after resuming"
        leftovers = [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]
        assert leftovers == [], f"killed {what}: temp dirs left after the resumed run saved: {leftovers}"


def _nth(n: int, match: Callable[[str], bool]) -> Callable[[str], bool]:
    seen = [0]

    def when(line: str) -> bool:
        seen[0] += match(line)
        return seen[0] == n

    return when
