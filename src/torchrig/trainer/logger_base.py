"""The Logger interface the Trainer writes metrics through.

Metric values arrive as tensors that may live on the accelerator. A logger keeps them there
and converts them to Python numbers in one batch when it writes (``flush``), so logging every
step costs no per-step host-device sync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Logger:
    """Base class of loggers.

    Subclasses implement :meth:`log_metrics`, :meth:`log_hyperparams` and :meth:`flush`.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def version(self) -> int | str:
        return 0

    @property
    def log_dir(self) -> Path | None:
        """The run directory where this logger writes (None if it writes nowhere)."""
        return None

    def log_metrics(self, metrics: dict[str, float | torch.Tensor], step: int) -> None:
        """Record ``metrics`` at ``step``; tensors may stay on the device until ``flush``."""
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Write what is buffered (one host sync for everything buffered)."""

    def after_save_checkpoint(self, path: Path) -> None:
        """The Trainer saved the checkpoint directory ``path`` (called on every rank once the save
        is complete, from :meth:`Trainer.save_checkpoint <torchrig.Trainer.save_checkpoint>`).
        Nothing by default; a logger of a tracking service records it."""

    def finalize(self, status: str) -> None:
        """The run ended with ``status`` ("success", "failed", "interrupted"): flush and close."""
        self.flush()
