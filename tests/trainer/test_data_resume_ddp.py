"""A Hugging Face stream under 2 gloo processes: each rank reads its own share (disjoint, together
the whole stream), and a fit stopped and resumed twice inside the epoch equals the uninterrupted one;
one shuffled with a buffer (whose state does not hold it) resumes exactly too, by replaying. A
replayed stream's position saved by 2 processes resumes under 1 only when each process read the
stream whole; and a position from 4 processes loaded and saved again by 2 keeps every rank's part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset
from trainer_helpers import HERE, run_child, subprocess_env

import torchrig

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


class Numbers(IterableDataset):  # type: ignore[type-arg]
    """0..39, no position of its own (a resume replays its epoch); rank r of R reads every R-th from r."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.rank, 40, self.world_size))

    def shard_for_rank(self, rank: int, world_size: int) -> Numbers:
        return Numbers(rank, world_size)


class Whole(IterableDataset):  # type: ignore[type-arg]
    """0..39, no position, no split: every process reads it whole."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(40))


SAVED_BY_TWO = r"""
import sys, warnings
from pathlib import Path
import torch
from torch.utils.data import DataLoader
import torchrig
from test_data_resume_ddp import Numbers, Whole


def after_three(loader):
    it = iter(loader)
    for _ in range(3):
        next(it)
    return loader.state_dict()


def run(rig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (prepare's warning that each process reads Whole whole)
        split = after_three(rig.prepare(DataLoader(Numbers(), batch_size=4)))
        whole = after_three(rig.prepare(DataLoader(Whole(), batch_size=4)))
        # A position saved by 4 processes (each rank's epoch RNG state its own), loaded here by 2
        # and saved again before a batch: all 4 ranks' states, as given.
        rngs = []
        for rank in range(4):
            torch.manual_seed(rank)
            rngs.append({"torch": torch.get_rng_state(), "generator": None})
        four = dict(whole, epoch_rng=rngs)
        loader = rig.prepare(DataLoader(Whole(), batch_size=4))
        loader.load_state_dict(four)
        again = loader.state_dict()
    kept = [rank for rank, rng in enumerate(again.pop("epoch_rng")) if torch.equal(rng["torch"], rngs[rank]["torch"])]
    assert again == {key: value for key, value in whole.items() if key != "epoch_rng"}, again
    if rig.global_rank == 0:
        torch.save({"split": split, "whole": whole}, Path(sys.argv[1]) / "states.pt")
    return kept


if __name__ == "__main__":
    print("result:", torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(run), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.distributed
def test_a_replayed_stream_saved_by_two_processes_resumes_on_one_only_when_it_was_not_split(tmp_path: Path) -> None:
    # 2 gloo processes read 3 batches of a stream split across them (shard_for_rank) and of one
    # each reads whole, and save both positions; each rank saves a 4-process position again as given.
    done = run_child(tmp_path, SAVED_BY_TWO, str(tmp_path), timeout=55)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result: [0, 1, 2, 3]" in done.stdout, done.stdout + done.stderr[-3000:]
    states = torch.load(tmp_path / "states.pt")
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    # Rank 0 of 2 read 0, 2, ... 22: replayed on 1 process the next batch would be 12..15, not the
    # 24, 26, ... (and rank 1's 25, 27, ...) of the uninterrupted 2-process run: refused.
    assert states["split"]["num_replicas"] == 2
    with pytest.raises(ValueError) as err:
        rig.prepare(torch.utils.data.DataLoader(Numbers(), batch_size=4)).load_state_dict(states["split"])
    assert str(err.value) == (
        "the checkpoint's Numbers stream was saved by 2 processes, each at its own position in its share of the "
        "stream; this run has 1. Resume it with 2 processes: a position in one share of a stream does not say "
        "where another number of shares would be"
    )
    # Every process read the whole stream: one process resumes it where each of the two was.
    assert states["whole"]["num_replicas"] == 1
    resumed = rig.prepare(torch.utils.data.DataLoader(Whole(), batch_size=4))
    resumed.load_state_dict(states["whole"])
    with pytest.warns(UserWarning, match="reads the 3 batches it already trained on again"):
        batches = [batch.tolist() for batch in resumed]
    assert batches == [list(range(i, i + 4)) for i in range(12, 40, 4)]
