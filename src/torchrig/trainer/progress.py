"""``ProgressBar``: a rich progress bar for fit/validate/test/predict, or plain lines.

In a terminal (or Jupyter) it draws one bar for training and one for the evaluation running,
with it/s, ETA, the loss and the metrics logged with ``prog_bar=True``, and leaves one finished
line per epoch above the bar (the same line plain output prints; epochs counted from 0, as
checkpoint names count them: :func:`~torchrig.checkpoint.meta.epoch_text`), so the history stays on screen
and an epoch shorter than ``refresh_interval`` still shows its steps, rate and metrics (lines of
short epochs are printed together, at most every ``refresh_interval``). Elsewhere
(a log file, CI) it prints one line per training epoch and per evaluation with the metrics.

The bar costs nothing measurable: the Trainer calls its training batch end at most every
``refresh_interval`` seconds and for the last batch of an epoch (a clock read per step, no call;
see :mod:`torchrig.trainer.callbacks`); the screen is redrawn at most that often, and only then
are the metrics (device tensors) converted to numbers, with one host-device sync per device. An
epoch's end only keeps its finished line's text and metric tensors: they are converted and
printed with the next redraw, all the epochs since the last one together (short epochs cost no
sync and no bar update each).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from torchrig import arguments
from torchrig.checkpoint.meta import epoch_text
from torchrig.trainer.callbacks import EVERY_TIME, Callback, EventSchedule
from torchrig.trainer.metrics import to_floats

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

    monitors_epoch_metrics = True  # on_train_epoch_end after the module's, once the epoch's metrics are in

    def __init__(self, *, refresh_interval: float = 0.5, console: Console | None = None) -> None:
        self.refresh_interval = arguments.finite_at_least(
            "refresh_interval", refresh_interval, 0.0, hint=" (seconds; default 0.5)"
        )
        self._console = console
        self._progress: Progress | None = None
        self._owns_progress = False  # started by fit (else by a standalone validate/test/predict)
        self._train_task = self._eval_task = TaskID(0)
        self._train = _Counter()
        self._eval = _Counter()
        self._last_draw = -math.inf  # the first draw is due at once (perf_counter counts from boot)
        self._loss: Any = None
        self._metrics_text = ""  # the training bar's metrics as last drawn
        self._logged_before: dict[str, Any] = {}
        # Epochs' finished lines not yet printed above the live bar: each line's text and its
        # metrics, still tensors (converted when printed).
        self._finished: list[tuple[str, dict[str, Any]]] = []
        self._shown_epoch = -1  # the epoch the training bar's description names
        # The epoch being trained, as it started: after the fit the loop's count is one past it.
        self._epoch = 0

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = Console()
        return self._console

    @property
    def is_live(self) -> bool:
        """Whether a live bar is drawn (a terminal or Jupyter) rather than plain lines."""
        return bool(self.console.is_terminal or self.console.is_jupyter)

    def event_schedule(self, event: str) -> EventSchedule:
        """:meth:`on_train_batch_end` at most every ``refresh_interval`` seconds (and for the last
        batch the loop runs): the bar reads where the epoch is from ``batch_idx``, so it need not
        see every batch, and a call per batch would cost a small model's step about 1%. Printing
        plain lines it needs only the last batch. Every other event every time."""
        if event == "on_train_batch_end":
            return EventSchedule(seconds=self.refresh_interval if self.is_live else math.inf)
        return EVERY_TIME

    # -- training --------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # Where the epoch is: a fit resumed mid-epoch starts there, with no epoch start.
        at = _batches_done(trainer)
        self._epoch = trainer.current_epoch
        self._train.start(_total(getattr(trainer, "num_training_batches", None)), at=at)
        if _rank_zero(trainer) and self.is_live:
            self._start(owned=True)
            if at:
                self._show_train(trainer, refresh=self._due())

    def _show_train(self, trainer: Trainer, *, refresh: bool) -> None:
        if self._progress is not None:
            desc = f"Epoch {epoch_text(self._epoch, getattr(trainer, 'max_epochs', None))}"
            fields = self._train.fields(self._metrics_text)
            self._progress.update(self._train_task, description=desc, visible=True, **fields)
            self._shown_epoch = self._epoch
            if refresh:
                self._progress.refresh()

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._loss = None
        self._epoch = trainer.current_epoch
        self._train.start(_total(getattr(trainer, "num_training_batches", None)))
        # Neither drawn nor updated now: a frame of "0/N" would take the rate limit's turn from
        # the epoch's batches (short epochs then only ever showed 0/N). The next redraw shows the
        # new epoch (_update_train).

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Called by the Trainer at most every refresh_interval seconds (see
        # event_schedule); called after every batch it shows the same. No conversion,
        # no sync unless it redraws.
        self._train.count = batch_idx + 1
        self._loss = outputs
        if self._progress is not None and self._due():
            self._draw_train(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not _rank_zero(trainer):
            return
        metrics = self._train_values(trainer)  # tensors: converted when the line is printed
        line = (
            f"Epoch {epoch_text(trainer.current_epoch, getattr(trainer, 'max_epochs', None))}: "
            f"{self._train.done()} steps in {self._train.elapsed():.2f}s ({self._train.rate():.1f} it/s)"
        )
        if self._progress is None:
            self.console.print(_join(line, to_floats(metrics)), highlight=False, soft_wrap=True)
            return
        # The line printed above the bar, and the bar at the epoch's end. Printing redraws the
        # live bar (about a millisecond), so lines are printed together at most every
        # refresh_interval, with the bar as it is then.
        self._finished.append((line, metrics))
        if self._due():
            self._print_finished(trainer)

    def _print_finished(self, trainer: Trainer | None = None) -> None:
        """Print the epochs' finished lines kept since the last redraw (their metrics converted
        together: one transfer per device), after bringing the bar up to date with the last."""
        if not self._finished:
            return
        merged = {f"{i}\0{name}": v for i, (_, values) in enumerate(self._finished) for name, v in values.items()}
        floats = to_floats(merged)
        lines = []
        for i, (line, values) in enumerate(self._finished):
            metrics = {name: floats[key] for name in values if (key := f"{i}\0{name}") in floats}
            lines.append(_join(line, metrics))
        if trainer is not None:
            self._update_train(trainer, metrics)
        self.console.print("\n".join(lines), highlight=False, soft_wrap=True)
        self._finished.clear()

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._progress is not None:
            self._update_train(trainer)  # the final state, whatever the rate limit skipped
        self._stop()

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._stop()

    # -- evaluation ------------------------------------------------------------------------
    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._logged_before = dict(getattr(trainer, "logged_metrics", None) or {})
        self._eval.start(_total(_eval_batches(trainer, stage)))
        if not (_rank_zero(trainer) and self.is_live):
            return
        if self._progress is None:
            self._start(owned=False)
        if self._progress is not None:
            self._progress.update(self._eval_task, description=_title(stage), visible=True, **self._eval.fields())
            if self._due():
                self._progress.refresh()

    def on_eval_batch_end(
        self, trainer: Trainer, module: TrainingModule, stage: str, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._eval.count += 1
        if self._progress is not None and self._due():
            self._progress.update(self._eval_task, **self._eval.fields())
            self._progress.refresh()

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not _rank_zero(trainer):
            return
        if self._progress is not None:
            self._progress.update(self._eval_task, visible=False)
            if not self._owns_progress:
                self._stop()  # a standalone validate/test/predict: its bar ends here
            elif self._due():
                self._draw_train(trainer)  # the new validation metrics on the training bar
        if stage.startswith("sanity") or (self.is_live and (self._owns_progress or stage == "predict")):
            return  # the training bar shows validation metrics; sanity/predict have none to show
        line = f"{_title(stage)}: {self._eval.count} batches in {self._eval.elapsed():.2f}s"
        metrics = {} if stage == "predict" else self._eval_metrics(trainer)
        self.console.print(_join(line, metrics), highlight=False, soft_wrap=True)

    def _eval_metrics(self, trainer: Trainer) -> dict[str, float]:
        """What this evaluation sent to the loggers (nothing if it logged nothing new)."""
        logged = dict(getattr(trainer, "logged_metrics", None) or {})
        fresh = {k: v for k, v in logged.items() if k != "epoch" and self._logged_before.get(k) is not v}
        return to_floats(fresh)

    # -- drawing ---------------------------------------------------------------------------
    def _due(self) -> bool:
        """Whether ``refresh_interval`` has passed since the last redraw (then it counts as one)."""
        now = time.perf_counter()
        if now - self._last_draw < self.refresh_interval:
            return False
        self._last_draw = now
        return True

    def _start(self, *, owned: bool) -> None:
        # Three columns, the numbers written by us into one: a redraw lays out a table, and each
        # column costs (six columns took about 1.6x the time of these three).
        progress = Progress(
            TextColumn("{task.description}", style="progress.description", markup=False),
            BarColumn(),
            TextColumn("{task.fields[info]}", markup=False),
            console=self.console,
            auto_refresh=False,  # no drawing thread competing with training for the GIL
        )
        # Both rows exist from the start and are shown/hidden with update(), because rich's
        # add_task and reset always redraw, which the rate limit must decide.
        self._train_task = progress.add_task("", total=None, visible=False, info="")
        self._eval_task = progress.add_task("", total=None, visible=False, info="")
        progress.start()
        self._progress, self._owns_progress = progress, owned

    def _stop(self) -> None:
        if self._progress is not None:
            self._print_finished()
            self._progress.stop()  # draws the final state
        self._progress = None
        self._owns_progress = False

    def _draw_train(self, trainer: Trainer) -> None:
        self._update_train(trainer)
        if self._progress is not None:
            self._progress.refresh()

    def _update_train(self, trainer: Trainer, metrics: dict[str, float] | None = None) -> None:
        if self._progress is not None:
            metrics = to_floats(self._train_values(trainer)) if metrics is None else metrics
            self._metrics_text = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            if self._shown_epoch != self._epoch:  # a new epoch since the last redraw
                self._show_train(trainer, refresh=False)
            else:
                self._progress.update(self._train_task, **self._train.fields(self._metrics_text))

    def _train_values(self, trainer: Trainer) -> dict[str, Any]:
        """The training bar's metrics as they are now (the last step's loss and the ``prog_bar``
        values), still tensors."""
        values: dict[str, Any] = {}
        loss = self._loss.get("loss") if isinstance(self._loss, dict) else self._loss
        if isinstance(loss, torch.Tensor) and isinstance(self._loss, dict) and "num_items" in self._loss:
            loss = loss.detach() / self._loss["num_items"]  # a token-weighted step: the mean per item
        if isinstance(loss, (torch.Tensor, float, int)):
            values["loss"] = loss
        values.update(getattr(trainer, "progress_bar_metrics", None) or {})
        return values


class _Counter:
    """Batches done in the running loop, with its rate and time left (our own, so that a
    restarted epoch does not confuse rich's speed estimate)."""

    def __init__(self) -> None:
        self.count = 0  # where the loop is: batches done in it
        self.base = 0  # where it was at start()
        self.total: float | None = None
        self.started = time.perf_counter()

    def start(self, total: float | None, at: int = 0) -> None:
        self.count = self.base = at
        self.total, self.started = total, time.perf_counter()

    def done(self) -> int:
        """Batches done since :meth:`start`."""
        return self.count - self.base

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)

    def rate(self) -> float:
        return self.done() / self.elapsed()

    def fields(self, metrics: str = "") -> dict[str, Any]:
        """The bar's task fields: ``completed``, ``total`` and ``info``, the text after the bar
        (``done/total``, time left, it/s, then ``metrics``)."""
        parts = [f"{self.count}/{self.total:.0f}" if self.total is not None else str(self.count)]
        if self.done():
            rate = self.rate()
            if self.total is not None:
                left = max(self.total - self.count, 0) / rate
                parts.append(time.strftime("%H:%M:%S", time.gmtime(left)) if left < 86400 else ">1 day")
            parts.append(f"{rate:.1f} it/s")
        if metrics:
            parts.append(metrics)
        return {"completed": self.count, "total": self.total, "info": " ".join(parts)}


def _batches_done(trainer: Trainer) -> int:
    """Batches of the current epoch already trained (non-zero when a fit resumes mid-epoch)."""
    return int(getattr(getattr(trainer, "fit_state", None), "batch_idx", 0))


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


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _join(line: str, metrics: dict[str, float]) -> str:
    return line if not metrics else line + ", " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
