"""WandbLogger and MLflowLogger on 2 CPU processes (DDP, gloo): rank zero alone makes one run of
each, with the exact values rank zero logged at the Trainer's steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from logger_helpers import exit_codes, float32, history, of_type, wandb_env, wandb_runs
from trainer_helpers import subprocess_env

from torchrig.trainer.loggers import read_metrics

SCRIPT = r"""
import sys
import torchrig
from logger_helpers import Counting
from trainer_helpers import loader

root = sys.argv[1]
trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, log_every_n_steps=1, enable_progress_bar=False,
    default_root_dir=root, callbacks=[torchrig.ModelCheckpoint(save_top_k=-1)],
    logger=[torchrig.CSVLogger(root_dir=root), torchrig.WandbLogger(offline=True), torchrig.MLflowLogger()],
)
module = Counting()
module.hparams = {"lr": 0.05}
trainer.fit(module, loader(16, batch_size=4), loader(8, batch_size=2))
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.slow  # 2 processes importing torch, wandb and mlflow: about 30 s here, 80 s on a busy machine
def test_two_processes_log_one_run_each_from_rank_zero(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env={**subprocess_env(), **wandb_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    csv_dir = tmp_path / "torchrig_logs" / "version_0"
    expected: dict[int, dict[str, float]] = {}
    for row in read_metrics(csv_dir):
        expected.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if k != "step"})
    # 16 samples, 2 ranks, batches of 4: 2 steps an epoch. Rank 1 would log seen = 10.5, 11.5.
    assert {s: r["seen"] for s, r in expected.items() if "seen" in r} == {1: 0.5, 2: 1.5, 3: 0.5, 4: 1.5}
    assert [s for s, r in expected.items() if "val_loss" in r] == [2, 4]

    (records,) = wandb_runs(tmp_path).values()  # one W&B run
    assert float32(history(records)) == float32(expected)
    assert exit_codes(records) == [0] and len(of_type(records, "artifact")) == 2

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("torchrig").experiment_id])  # one MLflow run
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.05"}
    got: dict[int, dict[str, float]] = {}
    for name in ("train_loss", "seen", "val_loss", "epoch"):
        for m in client.get_metric_history(run.info.run_id, name):
            got.setdefault(m.step, {})[name] = m.value
    assert float32(got) == float32(expected)
