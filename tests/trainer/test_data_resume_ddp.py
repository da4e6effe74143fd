"""A Hugging Face stream under 2 gloo processes: each rank reads its own share (disjoint, together
the whole stream), and a fit stopped and resumed twice inside the epoch equals the uninterrupted one;
one shuffled with a buffer (whose state does not hold it) resumes exactly too, by replaying."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import HERE, run_child, subprocess_env

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


BUFFERED = r"""
import re, warnings
import torch
from torch.utils.data import DataLoader
import torchrig
from test_data_resume import _hf_stream


def ids(loader, stop=None):
    # the ids of the batches of one epoch, up to ``stop`` of them (the epoch then left unfinished)
    seen = []
    for batch in loader:
        seen.append(batch["id"].tolist())
        if len(seen) == stop:
            loader.end_workers()
            break
    return seen


def run(rig):
    def make():
        stream = _hf_stream().shuffle(seed=3, buffer_size=6).map(lambda row: row)
        return rig.prepare(DataLoader(stream, batch_size=2, num_workers=2))

    loader = make()
    whole = ids(loader) + ids(loader)  # 2 epochs of this rank's share
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # stopped after batches 3 and 6 of epoch 0 and batch 2 of epoch 1, each resumed by a new loader
        steps = [lambda l: ids(l, 3), lambda l: ids(l, 3), lambda l: ids(l) + ids(l, 2), ids]
        pieces, state, rng = [], None, None
        for step in steps:
            loader = make()
            if state is not None:
                loader.load_state_dict(state)
                torch.set_rng_state(rng)
            pieces += step(loader)
            state, rng = loader.state_dict(), torch.get_rng_state()
    assert pieces == whole, (rig.global_rank, pieces, whole)
    replays = [re.search(r"reads the (\d+) batches", str(w.message)) for w in caught]
    assert [int(m.group(1)) for m in replays if m] == [3, 6, 2], [str(w.message) for w in caught]
    shares = rig.strategy.all_gather_object(sorted(i for batch in whole[:10] for i in batch))
    assert not set(shares[0]) & set(shares[1]), shares  # each rank its own share of epoch 0
    assert sorted(shares[0] + shares[1]) == list(range(40)), shares
    return f"ok {len(whole)} batches a rank"


if __name__ == "__main__":
    print("result:", torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(run), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.distributed
@pytest.mark.slow
def test_a_stream_shuffled_with_a_buffer_on_two_processes_resumes_exactly_by_replaying(tmp_path: Path) -> None:
    # Each rank's share of a buffered stream (split_dataset_by_node), 2 workers a rank, stopped
    # twice in epoch 0 and once in epoch 1: each resumed loader replays its rank's share of the
    # epoch up to the stop (its datasets state holds no buffer) and gives the uninterrupted batches.
    done = run_child(tmp_path, BUFFERED, timeout=55)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result: ok 20 batches a rank" in done.stdout, done.stdout + done.stderr[-3000:]
