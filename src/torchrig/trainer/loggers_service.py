"""What the loggers of tracking services (:class:`~torchrig.WandbLogger`,
:class:`~torchrig.MLflowLogger`) share with each other and with the CSV logger.

They buffer like :class:`~torchrig.CSVLogger` (tensors stay on their device until a flush reads
them all at once, so logging every step costs no per-step sync) and write on global rank zero
only. The service's run is opened on rank zero when something is first written, and closed by
``finalize`` with the fit's status; a later ``fit``/``validate``/``test`` with the same logger
reopens the same run. Checkpoints the Trainer saves are recorded in the run
(:meth:`Logger.after_save_checkpoint`).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torchrig.checkpoint.reading import read_meta
from torchrig.trainer.loggers import BufferedLogger

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer

__all__ = ["require"]

#: The statuses ``finalize`` is given (anything else is taken as a failure).
STATUSES = ("success", "failed", "interrupted")


def require(module: str, logger: str, extra: str) -> ModuleType:
    """Import ``module`` for ``logger``, or say how to install it (the ``extra`` of torchrig)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ModuleNotFoundError(
            f"{logger} needs the {module} package, which is not installed; install it with "
            f"`pip install 'torchrig[{extra}]'` (in a clone of torchrig: `pip install -e '.[{extra}]'`)",
            name=module,
        ) from err


class ServiceLogger(BufferedLogger):
    """A buffered logger that writes into a run of a tracking service (subclasses say which).

    The run directory is ``<save_dir>/<name>/version_N``, as the CSV logger's (checkpoints go
    into its ``checkpoints``, and ``ckpt_path="last"`` or a restarted job finds the newest
    earlier run's ``last`` beside it); ``save_dir`` defaults to the Trainer's
    ``default_root_dir``. Subclasses implement :meth:`_open`, :meth:`_end`, :meth:`_write`,
    :meth:`_write_hparams` and :meth:`_log_checkpoint`.
    """

    def __init__(
        self,
        *,
        save_dir: str | os.PathLike[str] | None,
        name: str,
        log_model: bool,
        flush_every_n_steps: int | None,
        flush_every_seconds: float | None,
        rank_zero: bool | None,
    ) -> None:
        if not isinstance(log_model, bool):
            raise ValueError(f"log_model={log_model!r} must be True or False")
        super().__init__(
            root_dir="." if save_dir is None else save_dir,
            name=name,
            version=None,
            flush_every_n_steps=flush_every_n_steps,
            flush_every_seconds=flush_every_seconds,
            rank_zero=rank_zero,
        )
        self.log_model = log_model
        self._save_dir_given = save_dir is not None
        self._opened = False  # whether this process has the service's run open

    def __getstate__(self) -> dict[str, Any]:
        # A started process opens the run again itself (a client or a run handle stays here).
        return {**super().__getstate__(), **dict.fromkeys(self._handles, None), "_opened": False}

    #: The attributes that hold the open run (not sent to a started process).
    _handles: tuple[str, ...] = ()

    def attach(self, trainer: Trainer) -> None:
        super().attach(trainer)
        if not self._save_dir_given and self._run._path is None:
            self._run.root_dir = Path(trainer.default_root_dir)

    @property
    def save_dir(self) -> Path:
        """Where the runs go: ``save_dir`` if given, else the Trainer's ``default_root_dir``."""
        return self._run.root_dir

    def _ensure_open(self) -> None:
        if not self._opened:
            self._open()
            self._opened = True

    def after_save_checkpoint(self, path: Path) -> None:
        """Record the checkpoint at ``path`` in the run (its files too with ``log_model=True``)."""
        if not self.is_writer:
            return
        path = Path(path).resolve()
        # The checkpoint's own step (a background save is committed, and heard of, steps later).
        step = read_meta(path).get("step")
        self._ensure_open()
        self._log_checkpoint(path, step if isinstance(step, int) else None)

    def finalize(self, status: str) -> None:
        """Write what is buffered and close the run with ``status`` (see :data:`STATUSES`)."""
        self.flush()
        if self._opened and self.is_writer:
            self._opened = False
            self._end(status)

    # -- what a subclass does --------------------------------------------------------------
    def _open(self) -> None:
        """Open the run in the service (a new run, or the one this logger had before)."""
        raise NotImplementedError

    def _end(self, status: str) -> None:
        """Close the run, marked as ended with ``status``."""
        raise NotImplementedError

    def _log_checkpoint(self, path: Path, step: int | None) -> None:
        """Record the checkpoint directory ``path`` (saved at global step ``step``) in the run."""
        raise NotImplementedError
