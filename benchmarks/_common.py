"""Shared helpers for the benchmarks: paired timing, medians, and the result table.

Every benchmark here measures its contenders side by side in one process, on one thread. The
machine is a shared VM whose speed drifts by tens of percent within seconds, so a contender is
never compared with a run of the baseline far away in time: :func:`run_paired` runs each
contender right next to a run of its own of the baseline (alternating which goes first), and the
ratio reported is the median of those paired ratios, with a 95% confidence interval.
"""

from __future__ import annotations

import argparse
import math
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
    #: Per repeat, this contender's time over the baseline run right next to it (run_paired).
    ratios: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def ratio_to(self, base: Result) -> float:
        """Median of the paired ratios (or, without pairs, of the per-repeat ratios to ``base``)."""
        if self.ratios:
            return statistics.median(self.ratios)
        return statistics.median(a / b for a, b in zip(self.seconds, base.seconds, strict=True))

    def ratio_interval(self) -> tuple[float, float] | None:
        """A 95% confidence interval of the median paired ratio (order statistics; no
        assumption about the noise's distribution). None with fewer than 6 pairs."""
        return median_interval(self.ratios)


def median_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """Distribution-free 95% confidence interval of the median of ``values``."""
    n = len(values)
    if n < 6:
        return None
    k = max(0, math.floor((n - 1.96 * math.sqrt(n)) / 2))
    ordered = sorted(values)
    return ordered[k], ordered[n - 1 - k]


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


def run_paired(runners: dict[str, Runner | str], *, steps: int, repeats: int, warmup: int) -> list[Result]:
    """Time every runner ``repeats`` times, each run paired with a run of the first (the baseline).

    Per repeat and contender: the baseline and the contender back to back, the baseline first in
    even repeats and second in odd ones (so neither always gets the warmer cache), and their
    ratio recorded. The contenders take turns in a rotating order. A string instead of a runner
    says why that contender is missing. Runners time themselves with :data:`clock`.
    """
    results = {name: Result(name, missing=r if isinstance(r, str) else None) for name, r in runners.items()}
    live = {name: r for name, r in runners.items() if not isinstance(r, str)}
    base_name = next(iter(runners))
    base = live[base_name]
    for run in live.values():
        run(warmup)
    others = [name for name in live if name != base_name]
    for i in range(repeats):
        for name in others[i % len(others) :] + others[: i % len(others)] if others else []:
            if i % 2 == 0:
                b = base(steps)
                x = live[name](steps)
            else:
                x = live[name](steps)
                b = base(steps)
            results[base_name].seconds.append(b)
            results[name].seconds.append(x)
            results[name].ratios.append(x / b)
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
    paired = any(r.ratios for _, results, _ in rows for r in results)
    header = ["workload", "contender", unit, f"vs {base_name}" + (" (95% CI)" if paired else "")]
    body = []
    for workload, results, per in rows:
        for r in results:
            time = r.missing or f"{r.median * scale / per:,.1f}"
            ratio = r.missing or f"{r.ratio_to(results[0]):.3f}x"
            interval = r.ratio_interval()
            if not r.missing and interval is not None:
                ratio += f" ({interval[0]:.2f}-{interval[1]:.2f})"
            body.append([workload, r.name, time, ratio])
    return print_table(title, header, body, markdown=markdown, left=2, group=True)


def print_table(
    title: str,
    header: Sequence[str],
    body: Sequence[Sequence[str]],
    *,
    markdown: bool,
    left: int = 1,
    group: bool = False,
) -> str | None:
    """Print ``body`` under ``header``: markdown (returned too) or a rich table. The first ``left``
    columns are left-aligned, the rest right-aligned; with ``group``, rows sharing their first
    cell form one section that shows it once."""
    if markdown:
        align = "|" + "---|" * left + "--:|" * (len(header) - left)
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", align]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        text = "\n".join(lines)
        print(text)
        return text
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < left else "right")
    last = None
    for row in body:
        if not group:
            t.add_row(*row)
            continue
        if last is not None and row[0] != last:
            t.add_section()
        t.add_row(*([row[0] if row[0] != last else "", *row[1:]]))
        last = row[0]
    Console().print(t)
    return None
