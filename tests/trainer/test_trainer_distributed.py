"""The Trainer on 2 CPU processes: fit stays in sync, predict gathers in order, early stopping stops all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import subprocess_env

SCRIPT = r"""
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import torchrig
from trainer_helpers import Regressor, loader

torch.manual_seed(0)
module = Regressor()
trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, seed=3, enable_progress_bar=False,
    logger=False, enable_checkpointing=False, default_root_dir=sys.argv[1],
    callbacks=[torchrig.EarlyStopping(monitor="val_metric", strict=False)],
)
trainer.fit(module, loader(16, batch_size=2, shuffle=True), loader(8, batch_size=2))
flat = torch.cat([p.detach().flatten() for p in module.parameters()])
gathered = trainer.rig.all_gather(flat)  # every rank must hold the same weights
val_loss, steps = float(trainer.callback_metrics["val_loss"]), trainer.global_step
x = torch.arange(11.0).unsqueeze(1).repeat(1, 4)  # 11 samples: the sampler pads one


class Echo(Regressor):
    def predict_step(self, batch, batch_idx):
        return batch[0][:, 0].clone()


preds = trainer.predict(Echo(), DataLoader(TensorDataset(x), batch_size=2))


class NanOnRankOne(Regressor):
    def validation_step(self, batch, batch_idx):
        self.log("val_metric", float("nan") if self.trainer.rig.global_rank == 1 else 1.0)


trainer.max_epochs = 5
trainer.fit(NanOnRankOne(), loader(8, batch_size=2), loader(4, batch_size=2))
stopped = trainer.rig.all_gather(torch.tensor(trainer.current_epoch)).tolist()


class Reduces(Regressor):  # self.log(reduce_fx=..., sync_dist=True): over the batches, then the ranks
    def validation_step(self, batch, batch_idx):
        rank = float(self.trainer.rig.global_rank)
        self.log("rank_max", rank, reduce_fx="max", sync_dist=True)
        self.log("rank_sum", rank + 1, reduce_fx="sum", sync_dist=True)
        self.log("rank_min", rank, reduce_fx=torch.min, sync_dist=True)


reduced = trainer.validate(Reduces(), loader(8, batch_size=2))[0]
if trainer.is_global_zero:
    sys.stdout.write(json.dumps({
        "world": trainer.rig.world_size,
        "steps": steps,
        "same_weights": bool(torch.equal(gathered[0], gathered[1])),
        "val_loss": val_loss,
        "preds": torch.cat(preds).tolist(),
        "stopped_at": stopped,
        "reduced": reduced,
    }) + "\n")  # one write: ranks share the output
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_fit_predict_and_early_stopping_on_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["world"] == 2
    assert result["steps"] == 2 * 4  # 16 samples, 2 per rank per step, 2 ranks: 4 steps an epoch
    assert result["same_weights"]
    assert result["preds"] == [float(i) for i in range(11)]  # every sample once, in order
    # 2 validation batches a rank: the largest rank, the sum of (rank + 1) over 4 batches, the smallest
    assert result["reduced"] == {"rank_max": 1.0, "rank_sum": 2 * 1.0 + 2 * 2.0, "rank_min": 0.0}
    assert result["stopped_at"] == [1, 1]  # rank 1 saw NaN: both ranks stopped after the first epoch


SPAWN_SCRIPT = r"""
import json, sys
import torch
import torchrig
from trainer_helpers import Regressor, loader

if __name__ == "__main__":
    torch.manual_seed(0)
    module = Regressor()
    before = [p.detach().clone() for p in module.parameters()]
    ckpt = torchrig.ModelCheckpoint(monitor="val_loss")
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, enable_progress_bar=False,
        logger=False, callbacks=[ckpt], default_root_dir=sys.argv[1],
    )
    trainer.fit(module, loader(16, batch_size=2), loader(8, batch_size=2))
    val_loss = float(trainer.callback_metrics["val_loss"])  # predict starts with none, as Lightning's
    preds = trainer.predict(module, loader(5, batch_size=2))
    sys.stdout.write(json.dumps({
        "steps": trainer.global_step,
        "changed": not all(torch.equal(a, b) for a, b in zip(before, module.parameters())),
        "rows": [p.shape[0] for p in preds],
        "best": ckpt.best_model_path.rsplit("/", 1)[-1],
        "score": ckpt.best_model_score,
        "val_loss": val_loss,
        "after_predict": sorted(trainer.callback_metrics),
    }) + "\n")  # one write: ranks share the output
"""


@pytest.mark.timeout(200)
@pytest.mark.distributed
@pytest.mark.slow  # each spawned process imports torch again: about 20 s here, a minute on a busy machine
def test_ddp_spawn_brings_weights_and_results_back(tmp_path: Path) -> None:
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=190,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The callbacks ran in the started processes; their state comes back with the weights.
    assert result.pop("best") == "epoch=0-step=4" and result.pop("score") == result.pop("val_loss")
    # 5 samples: 3 + 2 per rank, padding dropped; predict logged nothing (its run starts with no metrics)
    assert result == {"steps": 4, "changed": True, "rows": [4, 1], "after_predict": []}
