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


def _bench(*args: str) -> str:
    """Run a benchmark script in a subprocess (its own torch threads and imports) and return its output."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / args[0]
    done = subprocess.run(
        [sys.executable, str(script), *args[1:]], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _ratio(text: str, row: str) -> float:
    """The ratio (``1.23x``) in the markdown table row of ``row``."""
    import re

    line = next(line for line in text.splitlines() if f"| {row} |" in line)
    found = re.search(r"\| (\d+\.\d+)x", line)
    assert found is not None, line
    return float(found.group(1))


@pytest.mark.slow  # a benchmark run: 3.6 s of CPU (measured on the shared 2-core machine)
def test_trainer_steps_benchmark_measures_every_configuration() -> None:
    out = _bench("trainer_steps.py", "--rounds", "1", "--steps", "150", "--flush-epochs", "1", "--markdown")
    for row in ("torchrig Trainer (defaults)", "torchrig Trainer no ckpt", "torchrig Trainer lean"):
        assert 0.5 < _ratio(out, row) < 3.0  # a real measurement: the same work on both sides
    assert "command: python benchmarks/trainer_steps.py --workload small --rounds 1 --steps 150" in out


@pytest.mark.slow  # a benchmark run: 4.7 s of CPU (measured on the shared 2-core machine)
def test_trainer_parts_suite_times_each_part_against_the_hand_written_loop() -> None:
    out = _bench("overhead.py", "--suite", "trainer-parts", "--workload", "small", "--repeats", "1", "--markdown")
    rows = ("torchrig Trainer lean", "bar only", "checkpointing only", "logger only", "torchrig Trainer")
    for row in rows:
        assert 0.5 < _ratio(out, row) < 3.0
    assert "Trainer.fit" not in out  # only the suite asked for


def test_data_resume_benchmark_measures_every_pipeline() -> None:
    out = _bench("data_resume.py", "--samples", "2000", "--repeats", "2", "--batches", "20", "--markdown")
    for row in ("map-style, shuffled", "iterable, stateful", "iterable, no position (replayed)"):
        assert _ratio(out, row) > 0
    for workload in ("2 workers, wall clock", "2 workers, this process's CPU", "0 workers, CPU"):
        assert f"| {workload} | rig.prepare(DataLoader) |" in out
    assert "| 20 batches | reading one batch ahead |" in out
    assert "| map-style shuffled, batch 64 | rig.prepare(DataLoader) |" in out
