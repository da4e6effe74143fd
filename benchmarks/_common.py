"""Shared helpers for the benchmarks: interleaved timing, medians, and the result table.

Every benchmark here measures its contenders side by side in one process, on one thread,
interleaving the repeats (A, B, C, A, B, C, ...) so that a slow patch of the machine hits every
contender alike, and reports the median of the repeats.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

#: A contender: called with a number of steps, runs them and returns the seconds they took.
Runner = Callable[[int], float]

#: The clock every contender should time itself with: this process's CPU time. On one thread it
#: equals wall time on an idle machine; on a shared one it leaves out the time others ran.
clock = time.process_time


@dataclass
class Result:
    """The timings of one contender on one workload."""

    name: str
    seconds: list[float] = field(default_factory=list)
    missing: str | None = None  # why it did not run ("not installed")

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def ratio_to(self, base: Result) -> float:
        """Median of the per-repeat ratios: each repeat is compared with the baseline's run right
        next to it in time, which cancels the slow and fast phases of a shared machine."""
        return statistics.median(a / b for a, b in zip(self.seconds, base.seconds, strict=True))


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per contender (median)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    return parser


def run_interleaved(runners: dict[str, Runner | str], *, steps: int, repeats: int, warmup: int) -> list[Result]:
    """Time every runner ``repeats`` times, interleaved; a string instead of a runner says why it is missing.

    Runners time themselves with :data:`clock`.
    """
    results = {name: Result(name, missing=r if isinstance(r, str) else None) for name, r in runners.items()}
    live = {name: r for name, r in runners.items() if not isinstance(r, str)}
    for run in live.values():
        run(warmup)
    order = list(live)
    for i in range(repeats):
        # Rotate who goes first, so no contender always runs right after the same neighbour.
        for name in order[i % len(order) :] + order[: i % len(order)]:
            results[name].seconds.append(live[name](steps))
    return list(results.values())


def environment_line(device: str) -> str:
    return (
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"device {device}, {torch.get_num_threads()} thread(s)"
    )


def table(
    title: str, rows: Sequence[tuple[str, Sequence[Result], int]], *, unit: str, scale: float, markdown: bool
) -> str | None:
    """Print one table: per workload, each contender's median time and its ratio to the first.

    ``rows`` holds ``(workload, results, per)``: times are shown as ``median * scale / per``.
    Returns the markdown text when ``markdown`` is set (also printed), else prints with rich.
    """
    base_name = rows[0][1][0].name
    header = ["workload", "contender", unit, f"vs {base_name}"]
    body = []
    for workload, results, per in rows:
        for r in results:
            time = r.missing or f"{r.median * scale / per:,.1f}"
            ratio = r.missing or f"{r.ratio_to(results[0]):.3f}x"
            body.append([workload, r.name, time, ratio])
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|---|---|--:|--:|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        text = "\n".join(lines)
        print(text)
        return text
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < 2 else "right")
    last = None
    for row in body:
        if last is not None and row[0] != last:
            t.add_section()
        t.add_row(*([row[0] if row[0] != last else "", *row[1:]]))
        last = row[0]
    Console().print(t)
    return None
