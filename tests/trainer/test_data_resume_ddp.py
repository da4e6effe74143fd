"""A Hugging Face stream under 2 gloo processes: each rank reads its own share (disjoint, together
the whole stream), and a fit stopped and resumed twice inside the epoch equals the uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import HERE, subprocess_env

SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
from torch.utils.data import DataLoader
import torchrig
from test_data_resume import IdRegressor, _hf_stream

root, max_steps = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
module = IdRegressor()
trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", seed=7, max_epochs=1, max_steps=max_steps,
    enable_progress_bar=False, enable_model_summary=False, logger=False, default_root_dir=root,
    num_sanity_val_steps=0,
    callbacks=[torchrig.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_last=True)],
)
resume = "last" if (root / "ck" / "last").exists() else None
trainer.fit(module, DataLoader(_hf_stream(), batch_size=2, num_workers=2), ckpt_path=resume)
with open(root / f"rank{trainer.global_rank}.jsonl", "a") as f:
    f.write(json.dumps(module.trained) + "\n")
if trainer.is_global_zero:
    torch.save(module.state_dict(), root / "final.pt")
"""


def _fit(root: Path, stops: list[int]) -> tuple[list[list[list[int]]], dict[str, torch.Tensor]]:
    root.mkdir()
    script = root / "fit.py"
    script.write_text(SCRIPT)
    env = subprocess_env()
    env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"
    for max_steps in [*stops, -1]:
        done = subprocess.run(
            [sys.executable, str(script), str(root), str(max_steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=110,
            cwd=root,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    ranks = []
    for rank in range(2):
        lines = (root / f"rank{rank}.jsonl").read_text().splitlines()
        ranks.append([batch for line in lines for batch in json.loads(line)])
    return ranks, torch.load(root / "final.pt")


@pytest.mark.timeout(330)
@pytest.mark.distributed
@pytest.mark.slow
def test_a_sharded_stream_on_two_processes_is_split_and_resumes_exactly(tmp_path: Path) -> None:
    whole, weights = _fit(tmp_path / "whole", [])
    seen = [sorted(i for batch in rank for i in batch) for rank in whole]
    assert not set(seen[0]) & set(seen[1])  # disjoint shares
    assert sorted(seen[0] + seen[1]) == list(range(40))  # together, the stream
    pieces, resumed = _fit(tmp_path / "pieces", [4])
    assert pieces == whole
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)  # bitwise
