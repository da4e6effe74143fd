""":class:`WandbLogger`: metrics, hyperparameters and checkpoints into a Weights & Biases run."""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Any

from torchrig.trainer.loggers_service import ServiceLogger, require
from torchrig.trainer.metric_buffer import MetricBuffer

__all__ = ["WandbLogger"]

_ID_CHARS = string.ascii_lowercase + string.digits  # what W&B's own run ids are made of


class WandbLogger(ServiceLogger):
    """Logs to a `Weights & Biases <https://wandb.ai>`_ run with the ``wandb`` package
    (``pip install 'torchrig[wandb]'``).

    Buffered like :class:`~torchrig.CSVLogger` (no per-step host sync: each flush reads every
    buffered value at once and sends the rows with ``run.log(row, step=global_step)``); only
    global rank zero opens the run and writes. The run's hyperparameters (``module.hparams``,
    logged when a fit starts) go to ``run.config``. Each checkpoint the Trainer saves is logged as
    a version of the ``model-<run id>`` artifact (type ``"model"``, metadata ``path`` and
    ``step``): a reference to the checkpoint directory, or with ``log_model=True`` its files. The
    run ends with the fit: exit code 0 for a fit that succeeded, 1 for one that raised (W&B shows
    it failed) or was interrupted (then also marked as preempting, so it can be resumed).

    Args:
        project: the W&B project (None: ``WANDB_PROJECT`` or W&B's default).
        name: the run's display name (None: W&B makes one up).
        save_dir: where W&B writes (its ``wandb/`` folder) and where the run directory
            ``<save_dir>/<project or "torchrig_logs">/version_N`` (checkpoints, ``hparams.yaml``)
            goes; None: the Trainer's ``default_root_dir``.
        offline: True to write the run only to disk (``wandb sync`` uploads it later); False
            leaves the mode to W&B (``WANDB_MODE``, online by default).
        log_model: also upload each checkpoint's files (they are only referenced by path
            otherwise).
        flush_every_n_steps: as for :class:`~torchrig.CSVLogger`.
        flush_every_seconds: as for :class:`~torchrig.CSVLogger` (default 10).
        rank_zero: whether this process writes; None asks the Trainer (global rank zero).
        **init_kwargs: passed on to ``wandb.init`` (``entity=``, ``tags=``, ``group=``, ``id=``
            to continue a run...).

    The run is ``logger.experiment`` (a ``wandb.Run``, opened on first use; None on other
    ranks than zero).

    Example:
        >>> # trainer = Trainer(logger=WandbLogger(project="mnist", offline=True), max_epochs=3)
    """

    _handles = ("_experiment",)

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        offline: bool = False,
        log_model: bool = False,
        *,
        flush_every_n_steps: int | None = None,
        flush_every_seconds: float | None = 10.0,
        rank_zero: bool | None = None,
        **init_kwargs: Any,
    ) -> None:
        require("wandb", "WandbLogger", "wandb")
        if not isinstance(offline, bool):
            raise ValueError(f"offline={offline!r} must be True or False")
        super().__init__(
            save_dir=save_dir,
            name=project or "torchrig_logs",
            log_model=log_model,
            flush_every_n_steps=flush_every_n_steps,
            flush_every_seconds=flush_every_seconds,
            rank_zero=rank_zero,
        )
        self.project, self.run_name, self.offline = project, name, offline
        # Chosen here, so that the processes a launch starts from this logger open the same run.
        self._run_id = str(init_kwargs.pop("id", None) or "".join(secrets.choice(_ID_CHARS) for _ in range(8)))
        self.init_kwargs = init_kwargs
        self._experiment: Any = None

    @property
    def experiment(self) -> Any:
        """The ``wandb.Run`` (opened on first use on global rank zero; None on the other ranks)."""
        if not self.is_writer:
            return None
        self._ensure_open()
        return self._experiment

    @property
    def run_id(self) -> str:
        """The W&B run's id (chosen when the logger is made, or ``id=`` of ``init_kwargs``)."""
        return self._run_id

    def _open(self) -> None:
        import wandb

        kwargs: dict[str, Any] = {
            "project": self.project,
            "name": self.run_name,
            "dir": str(self.save_dir),
            "id": self.run_id,
            "resume": "allow",  # a second fit/test with this logger continues the same run
            "reinit": "create_new",  # this logger's run, beside any other open in the process
        }
        if self.offline:
            kwargs["mode"] = "offline"
        kwargs.update(self.init_kwargs)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self._experiment = wandb.init(**kwargs)

    def _end(self, status: str) -> None:
        run, self._experiment = self._experiment, None
        if status == "interrupted":
            run.mark_preempting()
        run.finish(exit_code=0 if status == "success" else 1)

    def _write(self, buffer: MetricBuffer) -> None:
        self._ensure_open()
        run = self._experiment
        for step, epoch, metrics in buffer.drain():
            run.log(metrics if epoch is None else {**metrics, "epoch": epoch}, step=step)

    def _write_hparams(self, params: dict[str, Any]) -> None:
        self._ensure_open()
        self._experiment.config.update(params, allow_val_change=True)

    def _log_checkpoint(self, path: Path, step: int | None) -> None:
        import wandb

        run = self._experiment
        artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata={"path": str(path), "step": step})
        if self.log_model:
            artifact.add_dir(str(path))
        else:
            artifact.add_reference(path.as_uri(), checksum=False)
        run.log_artifact(artifact, aliases=["latest"] + ([] if step is None else [f"step-{step}"]))
