"""``metrics.csv`` on disk: a header and one line per step, appended to; what :class:`CSVLogger
<torchrig.trainer.loggers.CSVLogger>` writes through.

The file stays a valid CSV whatever arrives: a new metric name rewrites it once with the wider
header (to a temporary file renamed into place), and values of the step that ends the file (the
validation run at the end of an epoch after the step's own row was written, or the values a
resumed run logs at the step it resumed from) rewrite that last line merged, so a step has one
line. Every data cell is a number or empty, so a data line is its cells joined by commas.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

__all__ = ["MetricsFile", "read_rows"]

_EOL = "\r\n"  # the csv module's line end
#: How far back from the end of an existing file :func:`_last_line` reads at a time.
_CHUNK = 1 << 16


class MetricsFile:
    """Writes one ``metrics.csv``; an existing file (a resumed run) is continued.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> f = MetricsFile(path)
        >>> f.write(["1", "2"], ["0", "0"], {"loss": ["0.5", "0.25"]})
        >>> f.write(["2", "3"], ["0", "1"], {"val_loss": ["0.75", ""], "loss": ["", "0.125"]})
        >>> print(path.read_text().replace("\\r", ""), end="")
        step,epoch,loss,val_loss
        1,0,0.5,
        2,0,0.25,0.75
        3,1,0.125,
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        #: The header: ``step``, ``epoch`` and the metric names; read from the file on the first write.
        self.columns: list[str] | None = None
        #: The file's last line: where it starts (a byte offset) and its cells by column; None
        #: while the file holds no data line.
        self._last: tuple[int, dict[str, str]] | None = None
        self._headed = False  # whether the file exists with its header

    def write(self, steps: list[str], epochs: list[str], columns: dict[str, list[str]]) -> None:
        """Write rows given column by column as cell text (``csv_cells``' output): the steps, the
        epochs and each metric's cells (empty where a row has none). A first row at the step of
        the file's last line is merged into that line (its non-empty cells win; the line's
        epoch stays unless it has none)."""
        if not steps:
            return
        if self.columns is None:  # first write: continue an existing file (a resumed run)
            found = _read_header(self.path)
            self.columns, self._headed = found or ["step", "epoch"], found is not None
            self._last = _last_line(self.path, self.columns)
        known = set(self.columns)
        new = [k for k in columns if k not in known]
        self.columns = header = self.columns + new
        empty = [""] * len(steps)
        cells = zip(steps, epochs, *(columns.get(c, empty) for c in header[2:]), strict=True)
        lines = [",".join(line) for line in cells]
        keep: int | None = None  # where the file's last line starts, when it is written again merged
        if self._last is not None and self._last[1].get("step") == steps[0]:
            keep, old = self._last
            first = {c: old.get(c, "") for c in header}
            first["epoch"] = first["epoch"] or epochs[0]
            first.update((c, cells[0]) for c, cells in columns.items() if cells[0])
            lines[0] = ",".join(first[c] for c in header)
        text = "".join(line + _EOL for line in lines)
        if new or not self._headed:
            rows = read_rows(self.path) if self._headed else []
            if keep is not None:
                rows.pop()  # the last line, written again merged
            head = io.StringIO(newline="")
            writer = csv.writer(head)
            writer.writerow(header)
            writer.writerows([r.get(c, "") for c in header] for r in rows)
            data = (head.getvalue() + text).encode()
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.path)  # readers never see a half-written header
            end, self._headed = len(data), True
        else:
            with self.path.open("r+b" if keep is not None else "ab") as f:
                if keep is not None:
                    f.seek(keep)
                f.write(text.encode())
                f.truncate()
                end = f.tell()
        # Data lines are ASCII (numbers), so a line's characters are its bytes.
        self._last = end - len(lines[-1]) - len(_EOL), dict(zip(header, lines[-1].split(","), strict=True))


def read_rows(path: Path) -> list[dict[str, str]]:
    """The data lines of the CSV file ``path`` as dicts of cell text."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _read_header(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def _last_line(path: Path, header: list[str]) -> tuple[int, dict[str, str]] | None:
    """Where the last data line of ``path`` starts and its cells by column (None without one),
    read from the end of the file."""
    if not path.exists():
        return None
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail, start, cut = b"", end, -1
        while start > 0:
            start = max(0, start - _CHUNK)
            f.seek(start)
            tail = f.read(end - start)
            cut = tail.rfind(b"\n", 0, len(tail.rstrip(b"\r\n")))
            if cut >= 0:
                break
        line_start = start + cut + 1 if cut >= 0 else 0
    if line_start == 0:  # the header is the only line
        return None
    cells = tail[line_start - start :].decode().rstrip(_EOL).split(",")
    if len(cells) != len(header):  # not a line this writer would have written: never merged into
        return None
    return line_start, dict(zip(header, cells, strict=True))
