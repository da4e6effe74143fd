"""MLflowLogger: a local SQLite store read back with MlflowClient: metric history, params,
checkpoints, run status; the missing packages."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from unittest import mock

import pytest
from logger_helpers import Counting, Crashing, float32
from trainer_helpers import loader

import torchrig
from torchrig.trainer.loggers import read_metrics

pytestmark = pytest.mark.timeout(90)


def history(client, run_id: str, name: str) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


def test_a_fit_logs_metrics_params_and_checkpoints_to_a_local_store(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    listed = torchrig.MLflowLogger(experiment_name="exp", run_name="first")
    copied = torchrig.MLflowLogger(experiment_name="exp", log_model=True)
    csv = torchrig.CSVLogger(root_dir=tmp_path)
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, log_every_n_steps=1, enable_progress_bar=False,
        default_root_dir=tmp_path, logger=[listed, copied, csv],
        callbacks=[torchrig.ModelCheckpoint(save_top_k=-1, save_last=True)],
    )  # fmt: skip
    module = Counting()
    module.hparams = {"lr": 0.05, "opt": {"name": "sgd", "betas": [0.9, 0.99]}, "bias": True}
    trainer.fit(module, loader(16), loader(8))

    # No tracking_uri: one SQLite store under default_root_dir, read here by MLflow's own client.
    assert listed.store_uri == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=listed.store_uri)
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([listed.run_id, copied.run_id])
    run = client.get_run(listed.run_id)
    assert (run.info.run_name, run.info.status) == ("first", "FINISHED")
    assert run.data.params == {"lr": "0.05", "opt/name": "sgd", "opt/betas": "[0.9, 0.99]", "bias": "True"}

    # The run directory <default_root_dir>/<experiment>/version_N holds the checkpoints.
    run_dir = tmp_path / "exp" / "version_0"
    assert trainer.log_dir == listed.log_dir == run_dir and copied.log_dir == tmp_path / "exp" / "version_1"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch=0-step=4", "epoch=1-step=8", "last"]

    # Exact values at the Trainer's steps: 4 batches an epoch, 2 epochs, validation at each epoch's end.
    assert history(client, listed.run_id, "seen") == [(s, 0.5 + (s - 1) % 4) for s in range(1, 9)]
    assert history(client, listed.run_id, "epoch") == [(s, float(s > 4)) for s in range(1, 9)]
    for name in ("train_loss", "val_loss"):
        expected = {int(r["step"]): {name: r[name]} for r in read_metrics(csv.log_dir) if name in r}
        got = {step: {name: v} for step, v in history(client, listed.run_id, name)}
        assert float32(got) == float32(expected)  # the CSV file writes float32 values in their shortest form
    assert [s for s, _ in history(client, listed.run_id, "val_loss")] == [4, 8]

    # Each checkpoint listed (path and step); with log_model=True its files are artifacts too.
    listing = json.loads((Path(run.info.artifact_uri.removeprefix("file://")) / "checkpoints.json").read_text())
    assert listing == {
        "checkpoints": [
            {"path": str(run_dir / "checkpoints" / "epoch=0-step=4"), "step": 4},
            {"path": str(run_dir / "checkpoints" / "epoch=1-step=8"), "step": 8},
        ]
    }
    assert [a.path for a in client.list_artifacts(listed.run_id)] == ["checkpoints.json"]
    stored = [a.path for a in client.list_artifacts(copied.run_id, "checkpoints")]
    assert stored == ["checkpoints/epoch=0-step=4", "checkpoints/epoch=1-step=8"]
    files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(copied.run_id, stored[1])}
    assert files == {p.name for p in (run_dir / "checkpoints" / "epoch=1-step=8").iterdir()}  # the first logger's
    assert run.info.artifact_uri.startswith((tmp_path / "mlruns" / "artifacts").as_uri())


def test_a_crashed_fit_ends_the_run_failed_and_a_later_test_reopens_it(tmp_path: Path) -> None:
    logger = torchrig.MLflowLogger(flush_every_seconds=None)  # only the end of the fit flushes
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, log_every_n_steps=1, enable_progress_bar=False,
        enable_checkpointing=False, default_root_dir=tmp_path, logger=logger,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit(Crashing(), loader(16))
    client = logger.experiment
    assert client.get_run(logger.run_id).info.status == "FAILED"
    assert history(client, logger.run_id, "seen") == [(1, 0.5), (2, 1.5)]
    assert logger.log_dir == tmp_path / "torchrig" / "version_0"  # the default experiment name

    trainer.test(Counting(), loader(8))
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert [s for s, _ in history(client, logger.run_id, "test_loss")] == [2]

    logger.log_metrics({"loss": 1.0}, step=3)
    logger.finalize("interrupted")
    assert client.get_run(logger.run_id).info.status == "KILLED"


def test_only_rank_zero_makes_a_run_and_a_copy_for_another_process_logs_to_the_same_run(tmp_path: Path) -> None:
    other = torchrig.MLflowLogger(save_dir=tmp_path, rank_zero=False)
    other.log_hyperparams({"lr": 0.1})
    other.log_metrics({"loss": 1.0}, step=1)
    other.after_save_checkpoint(tmp_path)
    other.finalize("success")
    assert other.experiment is None and other.run_id is None and not (tmp_path / "mlruns").exists()

    zero = torchrig.MLflowLogger(save_dir=tmp_path, rank_zero=True, flush_every_n_steps=1)
    zero.log_metrics({"loss": 0.5}, step=1)
    copy = pickle.loads(pickle.dumps(zero))  # what a started process receives
    assert copy._client is None and copy.run_id == zero.run_id
    copy.log_metrics({"loss": 0.25}, step=2)
    copy.finalize("success")
    assert history(zero.experiment, zero.run_id, "loss") == [(1, 0.5), (2, 0.25)]


def test_a_tracking_uri_is_used_as_given(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    logger = torchrig.MLflowLogger(tracking_uri=uri, save_dir=tmp_path / "runs", flush_every_n_steps=1)
    logger.log_metrics({"loss": 0.5}, step=7)
    logger.finalize("success")
    from mlflow import MlflowClient

    assert history(MlflowClient(tracking_uri=uri), logger.run_id, "loss") == [(7, 0.5)]
    assert not (tmp_path / "runs" / "mlruns").exists()


def test_missing_mlflow_says_how_to_install() -> None:
    hint = "install it with `pip install 'torchrig[mlflow]'` (in a clone of torchrig: `pip install -e '.[mlflow]'`)"
    with (
        mock.patch.dict("sys.modules", {"mlflow": None}),
        pytest.raises(
            ModuleNotFoundError, match=r"^MLflowLogger needs the mlflow package, which is not installed; "
        ) as err,
    ):
        torchrig.MLflowLogger()
    assert hint in str(err.value) and err.value.name == "mlflow"
    # mlflow-skinny alone: its client works with a server, but the local store needs SQLAlchemy.
    with (
        mock.patch.dict("sys.modules", {"sqlalchemy": None}),
        pytest.raises(ModuleNotFoundError, match=r"^MLflowLogger's local store needs the sqlalchemy package") as err,
    ):
        torchrig.MLflowLogger()
    assert hint in str(err.value)
    with mock.patch.dict("sys.modules", {"sqlalchemy": None}):
        torchrig.MLflowLogger(tracking_uri="http://localhost:5000")


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^experiment_name='' must be a non-empty string$"):
        torchrig.MLflowLogger(experiment_name="")
    with pytest.raises(ValueError, match=r"^log_model='no' must be True or False$"):
        torchrig.MLflowLogger(log_model="no")  # type: ignore[arg-type]


def test_a_new_run_resumes_from_the_last_checkpoint_of_the_previous_one(tmp_path: Path) -> None:
    # Run directories are numbered as the CSV logger's: ckpt_path="last" (and a restarted job's
    # automatic resume) finds the newest earlier run's last beside the new one.
    def fit(epochs: int, ckpt_path: str | None) -> tuple[torchrig.Trainer, torchrig.MLflowLogger]:
        logger = torchrig.MLflowLogger()
        trainer = torchrig.Trainer(
            accelerator="cpu", devices=1, max_epochs=epochs, log_every_n_steps=1, enable_progress_bar=False,
            default_root_dir=tmp_path, logger=logger, callbacks=[torchrig.ModelCheckpoint(save_last=True)],
        )  # fmt: skip
        trainer.fit(Counting(), loader(16), ckpt_path=ckpt_path)
        return trainer, logger

    first, first_logger = fit(1, None)
    second, second_logger = fit(2, "last")
    assert (first.log_dir.name, second.log_dir.name) == ("version_0", "version_1")
    assert second.global_step == 8 and second_logger.run_id != first_logger.run_id
    assert [s for s, _ in history(second_logger.experiment, second_logger.run_id, "seen")] == [5, 6, 7, 8]
