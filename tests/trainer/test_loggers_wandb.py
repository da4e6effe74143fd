"""WandbLogger: an offline W&B run read back with wandb's own reader: history, config,
checkpoint artifacts, exit status; the missing package; the CLI selects it."""

from __future__ import annotations

import pickle
from pathlib import Path
from unittest import mock

import pytest
from logger_helpers import Counting, Crashing, exit_codes, float32, history, of_type, wandb_env, wandb_runs
from trainer_helpers import loader

import torchrig
from torchrig.trainer.loggers import read_metrics

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)


def test_a_fit_logs_history_config_and_checkpoints_to_an_offline_run(tmp_path: Path) -> None:
    referenced = torchrig.WandbLogger(project="proj", name="first", offline=True)
    uploaded = torchrig.WandbLogger(project="proj", offline=True, log_model=True, save_dir=tmp_path / "up")
    csv = torchrig.CSVLogger(root_dir=tmp_path)
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, log_every_n_steps=1, enable_progress_bar=False,
        default_root_dir=tmp_path, logger=[referenced, uploaded, csv],
        callbacks=[torchrig.ModelCheckpoint(save_top_k=-1, save_last=True)],
    )  # fmt: skip
    module = Counting()
    module.hparams = {"lr": 0.05, "opt": {"name": "sgd", "betas": [0.9, 0.99]}}
    trainer.fit(module, loader(16), loader(8))

    # The first logger names the run directory: <default_root_dir>/<project>/version_N, checkpoints in it.
    run_dir = tmp_path / "proj" / "version_0"
    assert referenced.log_dir == trainer.log_dir == run_dir and referenced.version == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch=0-step=4", "epoch=1-step=8", "last"]
    assert uploaded.log_dir == tmp_path / "up" / "proj" / "version_0"

    runs = wandb_runs(tmp_path)
    assert list(runs) == [referenced.run_id]
    records = runs[referenced.run_id]
    run = of_type(records, "run")[0]
    assert (run["project"], run["display_name"], run["run_id"]) == ("proj", "first", referenced.run_id)
    config = {k: v for r in of_type(records, "config") for k, v in r["update"].items() if k != "_wandb"}
    assert config == {"lr": 0.05, "opt": {"name": "sgd", "betas": [0.9, 0.99]}}

    # Every step's row, as the CSV logger wrote it (4 batches an epoch, 2 epochs); val_loss at the epochs' ends.
    rows = history(records)
    assert sorted(rows) == list(range(1, 9))
    assert [rows[s]["seen"] for s in range(1, 9)] == [0.5, 1.5, 2.5, 3.5] * 2
    assert [rows[s]["epoch"] for s in range(1, 9)] == [0] * 4 + [1] * 4
    expected: dict[int, dict[str, float]] = {}
    for row in read_metrics(csv.log_dir):
        expected.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if k != "step"})
    assert float32(rows) == float32(expected)  # the CSV file writes float32 values in their shortest form
    assert [s for s in rows if "val_loss" in rows[s]] == [4, 8]

    # Each checkpoint: a version of the run's model artifact, referencing the directory.
    artifacts = of_type(records, "artifact")
    assert [(a["name"], a["type"], sorted(a["aliases"])) for a in artifacts] == [
        (f"model-{referenced.run_id}", "model", ["latest", "step-4"]),
        (f"model-{referenced.run_id}", "model", ["latest", "step-8"]),
    ]
    for a, name, step in zip(artifacts, ["epoch=0-step=4", "epoch=1-step=8"], [4, 8], strict=True):
        path = run_dir / "checkpoints" / name
        assert a["metadata"] == f'{{"path":"{path}","step":{step}}}'
        files = {c["path"]: c for c in a["manifest"]["contents"]}
        assert "meta.json" in files and files["meta.json"]["ref"] == (path / "meta.json").as_uri()
    assert exit_codes(records) == [0]

    # log_model=True: the checkpoint's files themselves (staged for upload), not references.
    uploads = of_type(wandb_runs(tmp_path / "up")[uploaded.run_id], "artifact")
    assert [sorted(a["aliases"]) for a in uploads] == [["latest", "step-4"], ["latest", "step-8"]]
    for a in uploads:
        contents = a["manifest"]["contents"]
        assert "meta.json" in {c["path"] for c in contents}
        assert all("ref" not in c and "local_path" in c for c in contents)


def test_a_crashed_fit_ends_the_run_failed_with_what_was_logged(tmp_path: Path) -> None:
    logger = torchrig.WandbLogger(offline=True, flush_every_seconds=None)  # only the end of the fit flushes
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, log_every_n_steps=1, enable_progress_bar=False,
        enable_checkpointing=False, default_root_dir=tmp_path, logger=logger,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit(Crashing(), loader(16))
    records = wandb_runs(tmp_path)[logger.run_id]
    assert logger.log_dir == tmp_path / "torchrig_logs" / "version_0"  # no project: the CSV logger's folder name
    assert {s: r["seen"] for s, r in history(records).items()} == {1: 0.5, 2: 1.5}
    assert exit_codes(records) == [1]

    # The same logger in a later run reopens the same W&B run (a second transaction log).
    trainer.test(Counting(), loader(8))
    records = wandb_runs(tmp_path)[logger.run_id]
    assert exit_codes(records) == [1, 0]
    assert "test_loss" in history(records)[2]


def test_only_rank_zero_opens_a_run_and_a_copy_for_another_process_holds_no_run(tmp_path: Path) -> None:
    other = torchrig.WandbLogger(offline=True, save_dir=tmp_path, rank_zero=False)
    other.log_hyperparams({"lr": 0.1})
    other.log_metrics({"loss": 1.0}, step=1)
    other.after_save_checkpoint(tmp_path)
    other.finalize("success")
    assert other.experiment is None and not (tmp_path / "wandb").exists()

    zero = torchrig.WandbLogger(offline=True, save_dir=tmp_path, rank_zero=True)
    assert zero.experiment is not None
    copy = pickle.loads(pickle.dumps(zero))
    assert copy._experiment is None and copy.run_id == zero.run_id  # the same run, opened there
    zero.finalize("interrupted")
    records = wandb_runs(tmp_path)[zero.run_id]
    assert [r["type"] for r in records if r["type"] in ("preempting", "exit")] == ["preempting", "exit"]


def test_missing_wandb_says_how_to_install() -> None:
    with (
        mock.patch.dict("sys.modules", {"wandb": None}),
        pytest.raises(
            ModuleNotFoundError, match=r"^WandbLogger needs the wandb package, which is not installed; "
        ) as err,
    ):
        torchrig.WandbLogger()
    assert "install it with `pip install 'torchrig[wandb]'` (in a clone of torchrig: `pip install -e '.[wandb]'`)" in (
        str(err.value)
    )
    assert err.value.name == "wandb"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^offline='yes' must be True or False$"):
        torchrig.WandbLogger(offline="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^log_model=1 must be True or False$"):
        torchrig.WandbLogger(log_model=1)  # type: ignore[arg-type]


def test_the_cli_selects_the_service_loggers(tmp_path: Path) -> None:
    from cli_script import Line, Regressor

    from torchrig.trainer.cli import CLI

    root = f"--trainer.default_root_dir={tmp_path}"
    cli = CLI(Regressor, Line, run=False, args=["--trainer.logger=WandbLogger", "--trainer.logger.offline=true", root])
    (logger,) = cli.trainer.loggers
    assert isinstance(logger, torchrig.WandbLogger) and logger.offline is True
    assert logger.save_dir == tmp_path  # the Trainer's default_root_dir

    both = {
        "trainer": {
            "default_root_dir": str(tmp_path),
            "logger": [
                {"class_path": "WandbLogger", "init_args": {"project": "p", "offline": True, "log_model": True}},
                {"class_path": "MLflowLogger", "init_args": {"experiment_name": "e", "run_name": "r"}},
            ],
        }
    }
    cli = CLI(Regressor, Line, run=False, args=both)
    wandb_logger, mlflow_logger = cli.trainer.loggers
    assert (wandb_logger.project, wandb_logger.offline, wandb_logger.log_model) == ("p", True, True)
    assert isinstance(mlflow_logger, torchrig.MLflowLogger)
    assert (mlflow_logger.experiment_name, mlflow_logger.run_name, mlflow_logger.save_dir) == ("e", "r", tmp_path)


@pytest.mark.slow  # a new interpreter importing torch, wandb and mlflow: about 15 s here, 40 s on a busy machine
@pytest.mark.timeout(150)
def test_the_docs_example_runs(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    from trainer_helpers import ROOT, subprocess_env

    docs = (ROOT / "docs" / "trainer_tools.md").read_text()
    rest = docs[docs.index("### Weights & Biases and MLflow\n") :]
    code = re.search(r"```python\n(.*?)```", rest, re.S).group(1)  # type: ignore[union-attr]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={**subprocess_env(), **wandb_env(tmp_path)},
        capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-2:] == [f"FINISHED {{'lr': '0.1'}} {list(range(1, 13))}", "True"]
    (records,) = wandb_runs(tmp_path).values()
    assert sorted(history(records)) == list(range(1, 13)) and exit_codes(records) == [0]
    assert (tmp_path / "mlruns" / "mlflow.db").is_file()
