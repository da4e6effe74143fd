"""Buffers each process updates on its own (BatchNorm's running statistics) resume exactly on every
rank: 2 gloo processes, a Trainer fit with a checkpoint mid-epoch, resumed, against the run that
was never interrupted (each rank's whole state dict, and the validation loss each rank computes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import printed_json, run_child

import torchrig

SCRIPT = r"""
import json, sys
import torch
import torchrig
from trainer_helpers import loader

class Normalized(torchrig.TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), batch_size=len(x))  # this rank's own

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

def run(max_steps, ckpt_path=None, seed=0):
    torch.manual_seed(seed)
    module = Normalized()
    save = torchrig.ModelCheckpoint(every_n_train_steps=5, save_last=True)  # step 5 of 8: mid-epoch
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=2, strategy=sys.argv[1], sync_batchnorm=sys.argv[2] == "sync",
        max_steps=max_steps, enable_progress_bar=False, logger=False, num_sanity_val_steps=0,
        default_root_dir=f"root/{max_steps}{ckpt_path is None}", callbacks=[save], limit_val_batches=2,
    )
    trainer.fit(module, loader(64, batch_size=4), loader(16, batch_size=4), ckpt_path=ckpt_path)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.state_dict().items()}
    return trainer, full

straight, whole = run(8)
first, at_5 = run(5)
last = first.checkpoint_callback.resolve_dirpath(first).absolute() / "last"
again, resumed = run(8, ckpt_path=last, seed=9)
print(json.dumps({
    "rank": straight.global_rank,
    "last": str(last),
    "unequal": [k for k in whole if not torch.equal(resumed[k], whole[k])],
    "val_loss": float(straight.callback_metrics["val_loss"]),
    "resumed_val_loss": float(again.callback_metrics["val_loss"]),
    "mean": whole["net.1.running_mean"].tolist(),
    "mean_at_5": at_5["net.1.running_mean"].tolist(),
}), flush=True)
"""


def fit_twice(tmp_path: Path, strategy: str, sync: bool) -> list[dict]:
    """Each rank's result, by rank."""
    done = run_child(tmp_path, SCRIPT, strategy, "sync" if sync else "own", timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    results = sorted((r for r in printed_json(done.stdout) if isinstance(r, dict)), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], done.stdout
    return results


@pytest.mark.timeout(170)
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "sync", "same_statistics"),
    [
        ("fsdp", False, False),  # FSDP2 keeps each rank's statistics: saved per rank
        ("ddp", False, True),  # DDP broadcasts rank 0's buffers before every forward
        ("fsdp", True, True),  # SyncBatchNorm: statistics of the global batch, the same on every rank
    ],
)
def test_each_rank_resumes_with_its_own_batchnorm_statistics(
    tmp_path: Path, strategy: str, sync: bool, same_statistics: bool
) -> None:
    results = fit_twice(tmp_path, strategy, sync)
    assert (results[0]["mean"] == results[1]["mean"]) == same_statistics
    for r in results:  # every tensor of every rank, buffers too, and what each rank validates
        assert r["unequal"] == [], r
        assert r["resumed_val_loss"] == r["val_loss"], r
    if strategy == "fsdp" and not sync:  # another number of processes: rank 0's copy, and a warning
        module = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        wrapped = torch.nn.Module()
        wrapped.net = module
        rig = torchrig.Rig(accelerator="cpu")
        with pytest.warns(UserWarning) as caught:
            rig.load(results[0]["last"], {"module": wrapped}, strict=False)
        (message,) = [str(w.message) for w in caught if "differed" in str(w.message)]
        assert message == (
            "checkpoint entry 'module' was saved by 2 processes whose buffers ['net.1.running_mean', "
            "'net.1.running_var'] differed (each process's own BatchNorm statistics, say); this run has 1 "
            "process(es), so every process takes rank 0's copy: resume with 2 processes to give each its own"
        )
        assert module[1].running_mean.tolist() == results[0]["mean_at_5"] != results[1]["mean_at_5"]


RIG_SCRIPT = r"""
import json, sys
import torch, torchrig

strategy, blocking = sys.argv[1], sys.argv[2] == "blocking"
rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=strategy)

def build(seed):
    torch.manual_seed(seed)
    return rig.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)))

def whole(module):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in module.state_dict().items()}

model = build(0)
optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rig.global_rank))  # each rank its own batch
rig.backward(model(x).square().mean())
optimizer.step()
saved = whole(model)
handle = rig.save("ck/step-1", {"model": model}, blocking=blocking)
model(x + 1)  # the statistics move on after the call: the checkpoint holds those of the call
if not blocking:
    handle.wait()
other = build(1)
rig.load("ck/step-1", {"model": other})
loaded = whole(other)
print(json.dumps({
    "rank": rig.global_rank,
    "unequal": [k for k in saved if not torch.equal(saved[k], loaded[k])],
    "mean": saved["1.running_mean"].tolist(),
}), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.parametrize("blocking", ["blocking", "background"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rig_load_gives_each_rank_the_buffers_it_saved(tmp_path: Path, strategy: str, blocking: str) -> None:
    """``rig.save``/``rig.load`` in a loop of one's own, whole (DDP) and sharded (FSDP) checkpoints:
    right after the load, before any forward, each rank holds exactly the state dict it saved."""
    done = run_child(tmp_path, RIG_SCRIPT, strategy, blocking, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    results = sorted((r for r in printed_json(done.stdout) if isinstance(r, dict)), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], done.stdout
    assert results[0]["mean"] != results[1]["mean"]  # each rank's statistics of its own batch
    assert [r["unequal"] for r in results] == [[], []]
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with pytest.warns(UserWarning, match=r"saved by 2 processes whose buffers \['1.running_mean', '1.running_var'\]"):
        torchrig.Rig(accelerator="cpu").load(tmp_path / "ck" / "step-1", {"model": module})
    assert module[1].running_mean.tolist() == results[0]["mean"]
