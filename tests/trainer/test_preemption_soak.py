"""The preemption soak (issue 28): SIGTERM every few steps, resumed automatically each time, at
least three times inside one epoch, with gradient accumulation, validation inside the epoch, and
blocking or background saves. The batches trained, the final weights and the optimizer state
equal the run that was never stopped, bitwise; in one process and under ``torchrig run --devices 2``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from soak_fit import fit
from trainer_helpers import HERE, subprocess_env

import torchrig

#: 12 optimizer steps an epoch, 2 epochs: stopped after steps 1, 2, 4, 7 (epoch 1) and 13, 14 (epoch 2).
TERM_AT = [1, 2, 4, 7, 13, 14]


def _trained(root: Path, ranks: int) -> list[list[list[int]]]:
    return [[json.loads(line) for line in (root / f"rank{r}.jsonl").read_text().splitlines()] for r in range(ranks)]


def _assert_same(a: Path, b: Path, ranks: int) -> None:
    assert _trained(a, ranks) == _trained(b, ranks)
    fa, fb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert all(torch.equal(fa["weights"][k], fb["weights"][k]) for k in fa["weights"])  # bitwise
    sa, sb = fa["optimizer"]["state"], fb["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[p][k], sb[p][k]) for p in sa for k in sa[p])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "background"])
def test_soak_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> None:
    fit(tmp_path / "whole", [], async_save, 1)
    root = tmp_path / "soak"
    stops: list[Any] = []
    for attempt in range(len(TERM_AT) + 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))  # a restarted job resumes by itself
        try:
            fit(root, TERM_AT, async_save, 1)
            break
        except torchrig.Preempted as stop:
            stops.append(Path(stop.saved).name if stop.saved else None)
    assert stops == [f"epoch={s // 12}-step={s}" for s in TERM_AT]
    _assert_same(tmp_path / "whole", root, 1)


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.distributed
def test_soak_under_torchrig_run_with_two_processes(tmp_path: Path) -> None:
    env = subprocess_env()
    env["TORCHRIG_SIGNAL_CHECK_INTERVAL"] = "0"  # the ranks agree at every step: the stop comes a step or two later
    script = str(HERE / "soak_fit.py")
    run = [sys.executable, "-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu"]
    whole = subprocess.run(
        [*run, script, str(tmp_path / "whole"), "--devices", "2"], env=env, capture_output=True, text=True, timeout=120
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    term = "2,5,8"  # three resumes inside the first epoch (12 steps), each by torchrun's restart
    soak = subprocess.run(
        [*run, "--max-restarts", "3", script, str(tmp_path / "soak"), "--devices", "2", "--term-at", term,
         "--async-save"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert soak.returncode == 0, soak.stderr[-3000:]
    assert soak.stdout.count("resuming from") == 3, soak.stdout[-3000:]
    assert soak.stdout.count("continues in epoch 0/1 after") == 3, soak.stdout[-3000:]
    _assert_same(tmp_path / "whole", tmp_path / "soak", 2)
