"""Loggers: :class:`CSVLogger` (the Trainer's default) and :class:`TensorBoardLogger`.

Both write into a versioned run directory ``<root_dir>/<name>/version_N`` and keep logged
tensors where they are (on the accelerator) until a flush: every ``flush_every_seconds`` (10 s
by default; a crash loses at most that much of the metrics), every ``flush_every_n_steps``
logged steps if set, after ``MAX_BUFFERED_ROWS`` rows whatever the schedule, and at the end of
the run. A flush reads everything buffered in one pass (the values on an accelerator stacked
and moved once per device and dtype, see :class:`MetricBuffer`), so logging every step costs no
per-step sync. Only global rank zero writes.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from torchrig import arguments
from torchrig.trainer.logger_base import Logger
from torchrig.trainer.metric_buffer import MetricBuffer
from torchrig.trainer.metrics_file import MetricsFile, read_rows

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer

__all__ = [
    "CSVLogger",
    "MetricBuffer",
    "TensorBoardLogger",
    "csv_cells",
    "format_floats",
    "next_version_dir",
    "read_metrics",
]

METRICS_FILE = "metrics.csv"
#: A buffer this long is written whatever the flush schedule (it holds one small tensor per value).
MAX_BUFFERED_ROWS = 10_000
HPARAMS_FILE = "hparams.yaml"
_VERSION_RE = re.compile(r"^version_(\d+)$")


def made_dir(path: Path) -> None:
    """``path`` made a directory (with its parents); a file in its way is a ValueError naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = arguments.file_in_the_way(path)
        if blocking is None:
            raise
        raise ValueError(
            f"cannot make the run directory {path}: {blocking} exists and is not a directory; pass a root "
            "directory (default_root_dir=, root_dir=, --root-dir) that is a folder or does not exist yet"
        ) from None


def next_version_dir(parent: str | os.PathLike[str]) -> Path:
    """Create and return ``parent/version_N`` for the next free ``N``.

    Safe when several runs start at once: ``os.makedirs(exist_ok=False)`` claims a directory
    atomically, and a run that loses the race takes the next number.
    """
    parent = Path(parent)
    made_dir(parent)
    taken = [int(m.group(1)) for p in parent.iterdir() if (m := _VERSION_RE.match(p.name))]
    version = max(taken, default=-1) + 1
    while True:
        path = parent / f"version_{version}"
        try:
            os.makedirs(path, exist_ok=False)
            return path
        except FileExistsError:
            version += 1


@contextlib.contextmanager
def discarded_on_failure(path: str | os.PathLike[str] | None, *ours: str) -> Iterator[None]:
    """Run the block; if it raises, remove the run directory ``path`` when the run wrote nothing
    in it: it holds nothing, or only ``ours`` (files written before the run started, like the
    CLI's ``config.yaml``). A directory holding anything else is kept; ``None`` is nothing to do.
    """
    try:
        yield
    except BaseException:
        if path is not None:
            _discard_unused(Path(path), ours)
        raise


def _discard_unused(path: Path, ours: tuple[str, ...]) -> None:
    try:
        entries = list(path.iterdir())
    except OSError:  # gone already, or never made
        return
    if any(entry.name not in ours or not entry.is_file() for entry in entries):
        return
    for entry in entries:
        entry.unlink()
    path.rmdir()


class _RunDir:
    """Where a logger writes; shared by the loggers through composition, not inheritance."""

    def __init__(self, root_dir: str | os.PathLike[str], name: str, version: int | str | None) -> None:
        self.root_dir = Path(arguments.directory("root_dir", root_dir))
        self.name = name
        self.version = version
        self._path: Path | None = None

    def path(self, create: bool) -> Path:
        if self._path is None:
            if self.version is None:
                if not create:
                    return self.root_dir / self.name / "version_?"
                self._path = next_version_dir(self.root_dir / self.name)
                self.version = int(self._path.name.removeprefix("version_"))
            else:
                tag = self.version if isinstance(self.version, str) else f"version_{self.version}"
                self._path = self.root_dir / self.name / tag
                if create:
                    made_dir(self._path)
        return self._path


class BufferedLogger(Logger):
    """What both loggers share: run directory, buffering, flush schedule, rank zero, hparams."""

    def __init__(
        self,
        *,
        root_dir: str | os.PathLike[str] = ".",
        name: str = "torchrig_logs",
        version: int | str | None = None,
        flush_every_n_steps: int | None = None,
        flush_every_seconds: float | None = 10.0,
        rank_zero: bool | None = None,
    ) -> None:
        if flush_every_n_steps is not None:
            arguments.int_in_range("flush_every_n_steps", flush_every_n_steps, 1, hint=" (or None)")
        if flush_every_seconds is not None:
            hint = " (or None; default 10.0)"
            arguments.finite_at_least("flush_every_seconds", flush_every_seconds, 0.0, strict=True, hint=hint)
        self._run = _RunDir(root_dir, name, version)
        self.flush_every_n_steps = flush_every_n_steps
        self.flush_every_seconds = flush_every_seconds
        self._last_flush = time.monotonic()
        self._rank_zero = rank_zero
        self._trainer: Trainer | None = None
        self._writer: bool | None = None  # is_writer, once known
        self._buffer = MetricBuffer()

    # -- identity --------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._run.name

    @property
    def version(self) -> int | str:
        self._run.path(create=self.is_writer)
        return self._run.version if self._run.version is not None else 0

    @property
    def root_dir(self) -> Path:
        return self._run.root_dir

    @property
    def log_dir(self) -> Path:
        """The run directory ``<root_dir>/<name>/version_N`` (created on rank zero on first use)."""
        return self._run.path(create=self.is_writer)

    @property
    def is_writer(self) -> bool:
        """Whether this process writes: global rank zero (from the Trainer when attached)."""
        if self._rank_zero is not None:
            return self._rank_zero
        if self._trainer is not None:
            return bool(getattr(self._trainer, "is_global_zero", True))
        return int(os.environ.get("RANK", "0")) == 0

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to a started process asks its own rank again.
        return {**self.__dict__, "_writer": None}

    def attach(self, trainer: Trainer) -> None:
        """Called by the Trainer before it logs: rank and epoch are then read from it."""
        self._trainer, self._writer = trainer, None

    # -- the Logger interface --------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float | torch.Tensor], step: int) -> None:
        """Buffer ``metrics`` at ``step`` (tensors stay on their device); writes when a flush is due."""
        writer = self._writer
        if writer is None:  # asked once: the rank of a process does not change
            writer = self._writer = self.is_writer
        if not writer:
            return
        epoch = metrics.get("epoch")
        if type(epoch) is not int:
            if epoch is None and self._trainer is not None:
                epoch = getattr(self._trainer, "current_epoch", None)
            epoch = None if epoch is None else int(epoch)
        # The Trainer's own row (Run.logged): its tensors are kept as they are, no copies.
        owned = metrics is getattr(getattr(self._trainer, "run", None), "logged", None)
        rows = self._buffer.add(metrics, step=step, epoch=epoch, skip="epoch", owned=owned)
        n, secs = self.flush_every_n_steps, self.flush_every_seconds
        if (
            rows >= MAX_BUFFERED_ROWS
            or (n is not None and rows >= n)
            or (secs is not None and time.monotonic() - self._last_flush >= secs)
        ):
            self.flush()

    def log_hyperparams(self, params: dict[str, Any] | Any) -> None:
        """Write ``params`` (a dict or an argparse/jsonargparse namespace) to ``hparams.yaml``."""
        if not self.is_writer:
            return
        clean = _plain(params if isinstance(params, dict) else vars(params))
        (self.log_dir / HPARAMS_FILE).write_text(yaml.safe_dump(clean, sort_keys=False))
        self._write_hparams(clean)

    def flush(self) -> None:
        """Write everything buffered now (one device-to-host transfer)."""
        self._last_flush = time.monotonic()
        if self.is_writer and len(self._buffer):
            self._write(self._buffer)

    def finalize(self, status: str) -> None:
        self.flush()
        self._close()

    # -- what a subclass writes ------------------------------------------------------------
    def _write(self, buffer: MetricBuffer) -> None:
        """Write what ``buffer`` holds, emptying it (``buffer.drain()`` or ``buffer.drain_columns()``)."""
        raise NotImplementedError

    def _write_hparams(self, params: dict[str, Any]) -> None:
        return None

    def _close(self) -> None:
        return None


class CSVLogger(BufferedLogger):
    """Writes ``metrics.csv`` and ``hparams.yaml`` into ``<root_dir>/<name>/version_N``.

    Columns are ``step``, ``epoch`` and the union of every metric name logged so far; when a
    new name appears the file is rewritten once with the wider header (atomically). A step is
    one row: values logged at the step of the row before (a callback's, the validation's at the
    end of an epoch, a resumed run's at the step it resumed from) join that row (see
    :class:`~torchrig.trainer.metrics_file.MetricsFile`).

    Args:
        root_dir: the directory that holds the runs (the Trainer passes ``default_root_dir``).
        name: the experiment's directory under ``root_dir``.
        version: ``None`` for the next free ``version_N``; an int for ``version_<int>``; a str
            for that directory name. An existing ``metrics.csv`` there is appended to.
        flush_every_n_steps: also write the buffer after this many ``log_metrics`` calls
            (default None: by time only).
        flush_every_seconds: write the buffer when this many seconds passed since the last
            write (checked at each ``log_metrics``; default 10, None for no time limit). Time, not
            a step count, bounds what a crash loses and keeps fast steps from flushing (one
            host-device sync each) dozens of times a second.
        rank_zero: whether this process writes; ``None`` asks the Trainer (global rank zero).

    Example:
        >>> import tempfile, torch
        >>> logger = CSVLogger(root_dir=tempfile.mkdtemp())
        >>> logger.log_metrics({"loss": torch.tensor(0.25)}, step=1)
        >>> logger.finalize("success")
        >>> read_metrics(logger.log_dir)
        [{'step': 1, 'loss': 0.25}]
    """

    _file: MetricsFile | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_file": None}  # a started process reads the file again

    @property
    def metrics_file(self) -> Path:
        return self.log_dir / METRICS_FILE

    def _write(self, buffer: MetricBuffer) -> None:
        if self._file is None:
            self._file = MetricsFile(self.metrics_file)
        self._file.write(*csv_cells(buffer))


class TensorBoardLogger(BufferedLogger):
    """Writes TensorBoard event files (and ``hparams.yaml``) into ``<root_dir>/<name>/version_N``.

    Needs the ``tensorboard`` package: ``pip install tensorboard``. Arguments as for
    :class:`CSVLogger`.

    Example:
        >>> import tempfile, torch
        >>> logger = TensorBoardLogger(root_dir=tempfile.mkdtemp())
        >>> logger.log_metrics({"loss": torch.tensor(0.25)}, step=1)
        >>> logger.finalize("success")
    """

    def __init__(
        self,
        *,
        root_dir: str | os.PathLike[str] = ".",
        name: str = "torchrig_logs",
        version: int | str | None = None,
        flush_every_n_steps: int | None = None,
        flush_every_seconds: float | None = 10.0,
        rank_zero: bool | None = None,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch raises ImportError when tensorboard is missing
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package, which is not installed; "
                "install it with `pip install tensorboard` "
                "(in a clone of torchrig: `pip install -e '.[tensorboard]'`), "
                "or use CSVLogger"
            ) from err
        super().__init__(
            root_dir=root_dir,
            name=name,
            version=version,
            flush_every_n_steps=flush_every_n_steps,
            flush_every_seconds=flush_every_seconds,
            rank_zero=rank_zero,
        )
        self._writer_class = SummaryWriter
        self._summary: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_summary": None}  # an open event file stays here

    @property
    def writer(self) -> Any:
        """The ``torch.utils.tensorboard.SummaryWriter`` (opened on first use, rank zero)."""
        if self._summary is None:
            self._summary = self._writer_class(log_dir=str(self.log_dir))
        return self._summary

    def _write(self, buffer: MetricBuffer) -> None:
        for step, epoch, metrics in buffer.drain():
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, global_step=step)
            if epoch is not None:
                self.writer.add_scalar("epoch", epoch, global_step=step)
        self.writer.flush()

    def _write_hparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten_params(params).items()}
        # Written into this run's event file (SummaryWriter.add_hparams would open a second run).
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def _close(self) -> None:
        if self._summary is not None:
            self._summary.close()
            self._summary = None


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, float | int]]:
    """The rows of ``run_dir/metrics.csv`` as dicts; empty cells are left out.

    ``step`` and ``epoch`` are ints, metrics floats.

    Example:
        >>> # rows = read_metrics("torchrig_logs/version_0"); [r["val_loss"] for r in rows if "val_loss" in r]
    """
    path = Path(run_dir)
    path = path if path.is_file() else path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {Path(run_dir)}; pass a run directory a CSVLogger wrote")
    out: list[dict[str, float | int]] = []
    try:
        for raw in read_rows(path):
            row: dict[str, float | int] = {}
            for key, cell in raw.items():
                if cell in ("", None):
                    continue
                row[key] = int(float(cell)) if key in ("step", "epoch") else float(cell)
            out.append(row)
    except (ValueError, TypeError, csv.Error) as err:  # not text, a cell that is no number, a broken line
        raise ValueError(f"{path} is not a {METRICS_FILE} that a CSVLogger wrote: {err}") from None
    return out


def _plain(obj: Any) -> Any:
    """``obj`` made of YAML-safe types (anything else becomes its ``repr``)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if hasattr(obj, "__dict__") and type(obj).__name__ == "Namespace":
        return _plain(vars(obj))
    return repr(obj)


def flatten_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``params`` with nested dicts as ``outer/inner`` keys (for places that take flat parameters)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(flatten_params(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def csv_cells(buffer: MetricBuffer) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Every row ``buffer`` holds as CSV cell text, column by column (empties it): the steps, the
    epochs (empty where none) and, per metric name in the order first logged, each row's value
    as :func:`format_floats` writes it (empty where the row has none), formatted in one
    vectorized call.

    Example:
        >>> buf = MetricBuffer()
        >>> _ = buf.add({"loss": torch.tensor(0.5)}, step=1, epoch=0)
        >>> _ = buf.add({"acc": 0.25}, step=2, epoch=None)
        >>> csv_cells(buf)
        (['1', '2'], ['0', ''], {'loss': ['0.5', ''], 'acc': ['', '0.25']})
    """
    steps, epochs, columns = buffer.drain_columns()
    text = iter(format_floats([v for column in columns.values() for v in column if v is not None]))
    cells = {name: ["" if v is None else next(text) for v in column] for name, column in columns.items()}
    return [str(s) for s in steps], ["" if e is None else str(e) for e in epochs], cells


def format_floats(values: list[float]) -> list[str]:
    """The text of each value for a CSV cell: a value a float32 holds exactly (what a float32,
    float16 or bfloat16 metric reads as) in the shortest form that gives that float32 back, so
    a logged ``0.49`` reads ``0.49``, not ``0.49000000953674316``; any other in Python's
    shortest form (``repr``). One vectorized conversion for all of them.

    Example:
        >>> format_floats([float(torch.tensor(0.49)), 1 / 3, 2.0**40 + 1])
        ['0.49', '0.3333333333333333', '1099511627777.0']
    """
    if not values:
        return []
    wide = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(np.float32)
        exact = narrow == wide  # False for NaN: Python writes it
    text: list[str] = narrow.astype(str).tolist()
    if not exact.all():
        for i in np.flatnonzero(~exact).tolist():
            text[i] = repr(values[i])
    return text
