"""The Trainer on 2 CPU processes (strategy="ddp", gloo): fit stays in sync, predict gathers in order."""

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
    callbacks=[torchrig.EarlyStopping(monitor="val_loss", patience=100)],
)
trainer.fit(module, loader(16, batch_size=2, shuffle=True), loader(8, batch_size=2))
flat = torch.cat([p.detach().flatten() for p in module.parameters()])
gathered = trainer.rig.all_gather(flat)  # every rank must hold the same weights
x = torch.arange(11.0).unsqueeze(1).repeat(1, 4)  # 11 samples: the sampler pads one


class Echo(Regressor):
    def predict_step(self, batch, batch_idx):
        return batch[0][:, 0].clone()


preds = trainer.predict(Echo(), DataLoader(TensorDataset(x), batch_size=2))
if trainer.is_global_zero:
    print(json.dumps({
        "world": trainer.rig.world_size,
        "steps": trainer.global_step,
        "same_weights": bool(torch.equal(gathered[0], gathered[1])),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "preds": torch.cat(preds).tolist(),
    }))
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_fit_and_predict_on_two_processes(tmp_path: Path) -> None:
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


SPAWN_SCRIPT = r"""
import json, sys
import torch
import torchrig
from trainer_helpers import Regressor, loader

if __name__ == "__main__":
    torch.manual_seed(0)
    module = Regressor()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, enable_progress_bar=False,
        logger=False, enable_checkpointing=False, default_root_dir=sys.argv[1],
    )
    trainer.fit(module, loader(16, batch_size=2), loader(8, batch_size=2))
    preds = trainer.predict(module, loader(5, batch_size=2))
    print(json.dumps({
        "steps": trainer.global_step,
        "changed": not all(torch.equal(a, b) for a, b in zip(before, module.parameters())),
        "rows": [p.shape[0] for p in preds],
    }))
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
    assert result == {"steps": 4, "changed": True, "rows": [4, 1]}  # 5 samples: 3 + 2 per rank, padding dropped
