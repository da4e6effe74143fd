""":class:`MLflowLogger`: metrics, hyperparameters and checkpoints into an MLflow run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from torchrig.trainer.loggers import flatten_params
from torchrig.trainer.loggers_service import ServiceLogger, require
from torchrig.trainer.metric_buffer import MetricBuffer

__all__ = ["LOCAL_STORE", "MLflowLogger"]

#: The folder under ``save_dir`` that holds the local store (``mlflow.db``) and its ``artifacts``.
LOCAL_STORE = "mlruns"
#: What MLflow takes in one ``log_batch`` call.
_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100
#: The longest parameter value MLflow stores; longer ones are cut.
_PARAM_LENGTH = 6000
_STATUS = {"success": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED
CHECKPOINTS_FILE = "checkpoints.json"


class MLflowLogger(ServiceLogger):
    """Logs to an `MLflow <https://mlflow.org>`_ run with MLflow's client
    (``pip install 'torchrig[mlflow]'``: ``mlflow-skinny`` and the SQLite store's ``sqlalchemy``
    and ``alembic``; the full ``mlflow`` package works too).

    Buffered like :class:`~torchrig.CSVLogger` (no per-step host sync: each flush reads every
    buffered value at once and sends them in ``log_batch`` calls, stamped with the flush's time);
    only global rank zero opens the run and writes. Metrics are logged at the Trainer's global
    step, with ``epoch`` beside them; the hyperparameters (``module.hparams``, logged when a fit
    starts) become the run's params (nested keys joined by ``/``, values as text). Each checkpoint
    the Trainer saves is listed in the run's ``checkpoints.json`` artifact (path and step), and
    with ``log_model=True`` its files are copied into the artifacts under
    ``checkpoints/<name>``. The run ends with the fit: ``FINISHED``, ``FAILED`` (the fit raised)
    or ``KILLED`` (interrupted).

    Args:
        experiment_name: the MLflow experiment (created if missing).
        run_name: the run's name (None: MLflow makes one up).
        tracking_uri: the tracking server or store (``http://...``, ``sqlite:///...``, ``databricks``);
            None: a local SQLite store ``<save_dir>/mlruns/mlflow.db`` with the artifacts in
            ``<save_dir>/mlruns/artifacts``; no server needed (look at it with
            ``mlflow ui --backend-store-uri sqlite:///<save_dir>/mlruns/mlflow.db``).
        log_model: also copy each checkpoint's files into the run's artifacts.
        save_dir: where the local store and the run directory ``<save_dir>/<experiment_name>/version_N``
            (checkpoints, ``hparams.yaml``) go; None: the Trainer's ``default_root_dir``.
        flush_every_n_steps: as for :class:`~torchrig.CSVLogger`.
        flush_every_seconds: as for :class:`~torchrig.CSVLogger` (default 10).
        rank_zero: whether this process writes; None asks the Trainer (global rank zero).

    ``logger.experiment`` is the ``mlflow.MlflowClient`` and ``logger.run_id`` the run's id (the
    run is created on first use on global rank zero).

    Example:
        >>> # trainer = Trainer(logger=MLflowLogger(experiment_name="mnist"), max_epochs=3)
    """

    _handles = ("_client",)

    def __init__(
        self,
        experiment_name: str = "torchrig",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        log_model: bool = False,
        *,
        save_dir: str | os.PathLike[str] | None = None,
        flush_every_n_steps: int | None = None,
        flush_every_seconds: float | None = 10.0,
        rank_zero: bool | None = None,
    ) -> None:
        require("mlflow", "MLflowLogger", "mlflow")
        if tracking_uri is None:  # the local SQLite store: mlflow-skinny alone lacks these
            require("sqlalchemy", "MLflowLogger's local store", "mlflow")
            require("alembic", "MLflowLogger's local store", "mlflow")
        if not isinstance(experiment_name, str) or not experiment_name:
            raise ValueError(f"experiment_name={experiment_name!r} must be a non-empty string")
        super().__init__(
            save_dir=save_dir,
            name=experiment_name,
            log_model=log_model,
            flush_every_n_steps=flush_every_n_steps,
            flush_every_seconds=flush_every_seconds,
            rank_zero=rank_zero,
        )
        self.experiment_name, self.run_name, self.tracking_uri = experiment_name, run_name, tracking_uri
        self._client: Any = None
        self._run_id: str | None = None
        self._checkpoints: list[dict[str, Any]] = []

    @property
    def experiment(self) -> Any:
        """The ``mlflow.MlflowClient`` of the run's store (None on ranks other than zero)."""
        if not self.is_writer:
            return None
        if self._client is None:
            from mlflow import MlflowClient

            if self.tracking_uri is None:
                (self.save_dir / LOCAL_STORE).mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self.store_uri)
        return self._client

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (the run is created on first use, on global rank zero)."""
        if self._run_id is None and self.is_writer:
            self._ensure_open()
        return self._run_id

    @property
    def store_uri(self) -> str:
        """The tracking URI: ``tracking_uri``, else the local store's ``sqlite:///...``."""
        if self.tracking_uri is not None:
            return self.tracking_uri
        return f"sqlite:///{(self.save_dir / LOCAL_STORE).resolve() / 'mlflow.db'}"

    def _open(self) -> None:
        client = self.experiment
        if self._run_id is None:
            run = client.create_run(self._experiment_id(client), run_name=self.run_name)
            self._run_id = run.info.run_id
        else:  # a later fit/test with this logger: the same run, running again
            client.update_run(self._run_id, status="RUNNING")

    def _experiment_id(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return str(found.experiment_id)
        where = None
        if self.tracking_uri is None:
            where = (self.save_dir / LOCAL_STORE / "artifacts").resolve().as_uri()
        try:
            return str(client.create_experiment(self.experiment_name, artifact_location=where))
        except MlflowException:  # another run created it meanwhile
            found = client.get_experiment_by_name(self.experiment_name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _end(self, status: str) -> None:
        self._client.set_terminated(self._run_id, status=_STATUS.get(status, "FAILED"))

    def _write(self, buffer: MetricBuffer) -> None:
        from mlflow.entities import Metric

        self._ensure_open()
        now = int(time.time() * 1000)
        metrics = []
        for step, epoch, values in buffer.drain():
            metrics += [Metric(name, value, now, step) for name, value in values.items()]
            if epoch is not None:
                metrics.append(Metric("epoch", float(epoch), now, step))
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + _METRICS_PER_BATCH])

    def _write_hparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self._ensure_open()
        flat = [Param(k, str(v)[:_PARAM_LENGTH]) for k, v in flatten_params(params).items()]
        for i in range(0, len(flat), _PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=flat[i : i + _PARAMS_PER_BATCH])

    def _log_checkpoint(self, path: Path, step: int | None) -> None:
        self._checkpoints.append({"path": str(path), "step": step})
        self._client.log_dict(self._run_id, {"checkpoints": self._checkpoints}, CHECKPOINTS_FILE)
        if self.log_model:
            self._client.log_artifacts(self._run_id, str(path), f"checkpoints/{path.name}")
