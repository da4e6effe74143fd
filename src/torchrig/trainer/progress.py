"""``ProgressBar``: a rich progress bar for fit/validate/test/predict, or plain lines.

In a terminal (or Jupyter) it draws one bar for training and one for the evaluation running,
with it/s, ETA, the loss and the metrics logged with ``prog_bar=True``. Elsewhere (a log file,
CI) it prints one line per training epoch and per evaluation with the metrics.

The bar costs nothing measurable: a step only bumps a counter and reads the clock; the screen
is redrawn at most every ``refresh_interval`` seconds, and only then are the metrics (device
tensors) converted to numbers, with one host-device sync per device.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

__all__ = ["ProgressBar"]

_STAGE_TITLES = {
    "sanity": "Sanity check",
    "sanity_check": "Sanity check",
    "validate": "Validation",
    "validation": "Validation",
    "val": "Validation",
    "test": "Test",
    "predict": "Predict",
}


class ProgressBar(Callback):
    """Shows training and evaluation progress: it/s, ETA, loss and ``prog_bar`` metrics.

    The Trainer adds one when ``enable_progress_bar=True`` (the default); pass your own in
    ``callbacks=`` to change its settings.

    Args:
        refresh_interval: the least number of seconds between two redraws of the bar.
        console: the ``rich.console.Console`` to draw on (default: stdout). When it is not a
            terminal, plain lines are printed instead of a bar.

    Example:
        >>> bar = ProgressBar(refresh_interval=1.0)
        >>> # trainer = Trainer(callbacks=[bar])
    """

    def __init__(self, *, refresh_interval: float = 0.5, console: Console | None = None) -> None:
        if isinstance(refresh_interval, bool) or not isinstance(refresh_interval, (int, float)) or refresh_interval < 0:
            raise ValueError(f"refresh_interval={refresh_interval!r} must be a number of seconds >= 0 (default 0.5)")
        self.refresh_interval = float(refresh_interval)
        self._console = console
        self._progress: Progress | None = None
        self._owns_progress = False
        self._train_task: TaskID | None = None
        self._eval_task: TaskID | None = None
        self._count = 0
        self._eval_count = 0
        self._last_draw = 0.0
        self._epoch_start = 0.0
        self._eval_start = 0.0
        self._loss: Any = None
        self._logged_before: dict[str, Any] = {}

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = Console()
        return self._console

    @property
    def is_live(self) -> bool:
        """Whether a live bar is drawn (a terminal or Jupyter) rather than plain lines."""
        return bool(self.console.is_terminal or self.console.is_jupyter)

    # -- training --------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _rank_zero(trainer) and self.is_live:
            self._start(owned=True)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._count = 0
        self._loss = None
        self._epoch_start = self._last_draw = time.perf_counter()
        if self._progress is None:
            return
        total = _total(getattr(trainer, "num_training_batches", None))
        desc = f"Epoch {trainer.current_epoch + 1}{_of(getattr(trainer, 'max_epochs', None))}"
        if self._train_task is None:
            self._train_task = self._progress.add_task(desc, total=total, metrics="", speed="")
        else:
            self._progress.reset(self._train_task, total=total, description=desc, metrics="", speed="")
        self._progress.refresh()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The hot path: a counter, a reference and a clock read. No conversion, no sync.
        self._count += 1
        self._loss = outputs
        if self._progress is not None:
            now = time.perf_counter()
            if now - self._last_draw >= self.refresh_interval:
                self._last_draw = now
                self._draw_train(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not _rank_zero(trainer):
            return
        if self._progress is not None:
            self._draw_train(trainer)
            return
        elapsed = max(time.perf_counter() - self._epoch_start, 1e-9)
        line = (
            f"Epoch {trainer.current_epoch + 1}{_of(getattr(trainer, 'max_epochs', None))}: "
            f"{self._count} steps in {elapsed:.2f}s ({self._count / elapsed:.1f} it/s)"
        )
        self.console.print(_join(line, self._train_metrics(trainer)), highlight=False, soft_wrap=True)

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._stop()

    # -- evaluation ------------------------------------------------------------------------
    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._eval_count = 0
        self._logged_before = dict(getattr(trainer, "logged_metrics", None) or {})
        self._eval_start = self._last_draw = time.perf_counter()
        if not (_rank_zero(trainer) and self.is_live):
            return
        if self._progress is None:
            self._start(owned=False)
        progress = self._progress
        if progress is None:
            return
        total = _total(_eval_batches(trainer, stage))
        self._eval_task = progress.add_task(_title(stage), total=total, metrics="", speed="")
        self._progress.refresh()

    def on_eval_batch_end(
        self, trainer: Trainer, module: TrainingModule, stage: str, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._eval_count += 1
        if self._progress is not None and self._eval_task is not None:
            now = time.perf_counter()
            if now - self._last_draw >= self.refresh_interval:
                self._last_draw = now
                self._progress.update(self._eval_task, completed=self._eval_count)
                self._progress.refresh()

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not _rank_zero(trainer):
            return
        if self._progress is not None and self._eval_task is not None:
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
            if self._train_task is not None:
                self._draw_train(trainer)  # show the new validation metrics on the training bar
            else:
                self._progress.refresh()
            if not self._owns_progress:
                self._stop()
        elapsed = max(time.perf_counter() - self._eval_start, 1e-9)
        if stage.startswith("sanity") or (self.is_live and (self._train_task is not None or stage == "predict")):
            return  # the training bar shows validation metrics; sanity/predict have none to show
        line = f"{_title(stage)}: {self._eval_count} batches in {elapsed:.2f}s"
        metrics = {} if stage == "predict" else self._eval_metrics(trainer)
        self.console.print(_join(line, metrics), highlight=False, soft_wrap=True)

    def _eval_metrics(self, trainer: Trainer) -> dict[str, float]:
        """What this evaluation sent to the loggers (nothing if it logged nothing new)."""
        logged = dict(getattr(trainer, "logged_metrics", None) or {})
        fresh = {k: v for k, v in logged.items() if k != "epoch" and self._logged_before.get(k) is not v}
        return to_floats(fresh)

    # -- drawing ---------------------------------------------------------------------------
    def _start(self, *, owned: bool) -> None:
        self._progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[speed]}"),
            TextColumn("{task.fields[metrics]}"),
            console=self.console,
            auto_refresh=False,  # no drawing thread competing with training for the GIL
        )
        self._progress.start()
        self._owns_progress = owned

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
        self._progress = None
        self._train_task = self._eval_task = None

    def _draw_train(self, trainer: Trainer) -> None:
        if self._progress is None or self._train_task is None:
            return
        elapsed = max(time.perf_counter() - self._epoch_start, 1e-9)
        metrics = self._train_metrics(trainer)
        self._progress.update(
            self._train_task,
            completed=self._count,
            speed=f"{self._count / elapsed:.1f} it/s",
            metrics=" ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()),
        )
        self._progress.refresh()

    def _train_metrics(self, trainer: Trainer) -> dict[str, float]:
        values: dict[str, Any] = {}
        loss = self._loss.get("loss") if isinstance(self._loss, dict) else self._loss
        if isinstance(loss, (torch.Tensor, float, int)):
            values["loss"] = loss
        values.update(getattr(trainer, "progress_bar_metrics", None) or {})
        return to_floats(values)


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """``metrics`` with scalar tensors turned into floats, one host-device sync per device.

    Non-scalar tensors and values that are not numbers are left out.
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            by_device.setdefault(value.device, []).append((name, value.detach().reshape(())))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    for device, items in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64
        floats = torch.stack([t.to(dtype) for _, t in items]).tolist()
        out.update(zip((n for n, _ in items), floats))
    return {k: out[k] for k in metrics if k in out}  # keep the caller's order


def _rank_zero(trainer: Trainer) -> bool:
    return bool(getattr(trainer, "is_global_zero", True))


def _total(n: Any) -> float | None:
    """A batch count usable as a bar total (None: unknown length, an open-ended bar)."""
    if isinstance(n, (list, tuple)):
        n = sum(n) if all(isinstance(x, int) for x in n) else None
    return float(n) if isinstance(n, (int, float)) and 0 <= n < float("inf") else None


def _eval_batches(trainer: Trainer, stage: str) -> Any:
    key = {"test": "num_test_batches", "predict": "num_predict_batches"}.get(stage, "num_val_batches")
    if stage.startswith("sanity"):
        return getattr(trainer, "num_sanity_val_steps", None)
    return getattr(trainer, key, None)


def _title(stage: str) -> str:
    return _STAGE_TITLES.get(stage, stage.capitalize())


def _of(max_epochs: Any) -> str:
    return f"/{max_epochs}" if isinstance(max_epochs, int) and max_epochs > 0 else ""


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _join(line: str, metrics: dict[str, float]) -> str:
    return line if not metrics else line + ", " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
