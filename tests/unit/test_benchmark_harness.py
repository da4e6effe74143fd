"""The benchmarks' timing harness (benchmarks/_common.py): pairing and the median's interval."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import median_interval, run_paired


def test_median_interval_uses_order_statistics() -> None:
    assert median_interval([1.0] * 5) is None  # too few pairs to say anything
    values = [float(v) for v in range(21)]  # n=21: k = floor((21 - 1.96*sqrt(21)) / 2) = 6
    assert median_interval(values) == (6.0, 14.0)
    assert median_interval(list(reversed(values))) == (6.0, 14.0)


def test_run_paired_puts_every_run_next_to_a_baseline_run_alternating_the_order() -> None:
    calls: list[str] = []

    def runner(name: str, seconds: float):  # type: ignore[no-untyped-def]
        def run(steps: int) -> float:
            calls.append(name)
            return seconds * steps

        return run

    results = run_paired(
        {"base": runner("base", 1.0), "a": runner("a", 2.0), "b": runner("b", 3.0), "gone": "not installed"},
        steps=10,
        repeats=2,
        warmup=1,
    )
    # warm-up once each, then per repeat each contender with its own baseline run; the baseline
    # goes first in even repeats and second in odd ones, and the contenders take turns leading.
    assert calls == ["base", "a", "b", "base", "a", "base", "b", "b", "base", "a", "base"]
    by_name = {r.name: r for r in results}
    assert by_name["a"].ratios == [2.0, 2.0] and by_name["b"].ratios == [3.0, 3.0]
    assert by_name["a"].ratio_to(by_name["base"]) == pytest.approx(2.0)
    assert len(by_name["base"].seconds) == 4
    assert by_name["gone"].missing == "not installed" and by_name["gone"].seconds == []
