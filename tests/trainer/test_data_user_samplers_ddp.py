"""Samplers users build, under 2 gloo processes: ``BatchSampler(RandomSampler(data), 4)`` is split
across the ranks as ``shuffle=True`` is (2 x 4 per step: the batches of 1 process x 8), and a
``WeightedRandomSampler`` with its own generator (every rank reads it whole) resumes exactly,
stopped inside its first epoch and at its end (each rank's generator state is saved)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_helpers import run_child

SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler
import torchrig

root, kind = Path(sys.argv[1]), sys.argv[2]
devices, batch, max_steps = (int(a) for a in sys.argv[3:6])
data = TensorDataset(torch.arange(24.0).unsqueeze(1))
if kind == "batch_sampler":
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), batch, False))
else:
    g = torch.Generator().manual_seed(5)
    weighted = WeightedRandomSampler(torch.linspace(0.1, 1, 24), 24, generator=g)
    loader = DataLoader(data, batch_size=batch, sampler=weighted)


class Model(torchrig.TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append(x.flatten().int().tolist())
        return self.net(x / 24).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
model = Model()
trainer = torchrig.Trainer(
    accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", seed=3, max_epochs=2,
    max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    callbacks=[torchrig.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_last=True)],
)
trainer.fit(model, loader, ckpt_path="last" if (root / "ck" / "last").exists() else None)
with open(root / f"rank{trainer.global_rank}.jsonl", "a") as f:
    f.write(json.dumps(model.seen) + "\n")
if trainer.is_global_zero:
    (root / "weight.json").write_text(json.dumps(model.net.weight.item()))
"""


def _fit(root: Path, kind: str, devices: int, batch: int, stops: list[int]) -> tuple[list[list[list[int]]], float]:
    root.mkdir()
    for max_steps in [*stops, -1]:
        done = run_child(root, SCRIPT, str(root), kind, str(devices), str(batch), str(max_steps), timeout=100)
        assert done.returncode == 0, done.stderr[-3000:]
    ranks = []
    for rank in range(devices):
        lines = (root / f"rank{rank}.jsonl").read_text().splitlines()
        ranks.append([b for line in lines for b in json.loads(line)])
    return ranks, json.loads((root / "weight.json").read_text())


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.slow
def test_a_batch_sampler_of_a_random_sampler_is_split_across_two_processes_as_one_process_reads_it(
    tmp_path: Path,
) -> None:
    (one,), _ = _fit(tmp_path / "one", "batch_sampler", 1, 8, [])
    (rank0, rank1), _ = _fit(tmp_path / "two", "batch_sampler", 2, 4, [])
    assert len(one) == len(rank0) == len(rank1) == 6  # 3 steps an epoch, 2 epochs
    assert [sorted(a + b) for a, b in zip(rank0, rank1, strict=True)] == [sorted(b) for b in one]
    assert one[:3] != [list(range(i, i + 8)) for i in range(0, 24, 8)]  # shuffled, not in order


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.slow
def test_a_weighted_sampler_with_its_own_generator_resumes_exactly_on_two_processes(tmp_path: Path) -> None:
    whole, weight = _fit(tmp_path / "whole", "weighted", 2, 4, [])
    pieces, resumed = _fit(tmp_path / "pieces", "weighted", 2, 4, [2, 6])  # inside epoch 0, at its end
    assert len(whole[0]) == 12 and whole[0] != whole[0][6:] + whole[0][:6]  # each epoch its own draw
    assert pieces == whole
    assert resumed == weight
