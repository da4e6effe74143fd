"""The next GPU session's checks in one command, each part inside its own time budget.

    python benchmarks/gpu_session.py              # one H200: at most --total-budget (540 s) in all
    python benchmarks/gpu_session.py --smoke      # the same parts, tiny, on the CPU (a check that it runs)

The parts, in order (``PARTS``; each a child process):

1. ``pytest tests/gpu``;
2. issue 32's 1B model (18 blocks of width 2048): ``bf16-mixed`` against ``fp8-mixed`` tensorwise,
   rowwise and the candidate fix (``CANDIDATE``), for ``LONG_TOTAL`` steps (the loss compared over
   the last 10 and 50 steps, and the delay in steps; docs/speed.md says why longer than 200);
3. the width-4096 model (8 blocks, 1.88B) that met the target before: ``bf16-mixed`` against
   tensorwise and the candidate, ``WIDE_TOTAL`` steps (what the candidate costs in speed where
   tensorwise reached 1.23x).

A part that runs past its budget is stopped (its whole process group) with a line saying so, and the
session goes on with the next part; a part that would start with less than ``MIN_PART`` seconds of
the session's budget left is skipped with a line. ``gpu_fp8.py`` is also given a soft ``--budget``
``MARGIN`` seconds short of its part's, so it stops taking rounds and prints its table (with the
rounds it took) before the hard stop. Compilation is the one thing a budget cannot interrupt
(the last session's ``--single`` compiled for 80 s): it is counted inside the part's budget.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The fp8 contender that is the candidate fix for the 1B model's loss gap (a key of gpu_fp8.precisions()).
CANDIDATE = "tensorwise-exact"
#: Part 2's steps per contender: 8 warm-up + 26 rounds of 12.
LONG_TOTAL = 320
#: Part 3's steps per contender: 8 warm-up + 10 rounds of 12 (its 200-step losses were measured before).
WIDE_TOTAL = 128
#: Seconds gpu_fp8.py's own --budget stops short of its part's: its start (imports, CUDA) and its table.
MARGIN = 40.0
#: A part is not started with fewer seconds than this left.
MIN_PART = 20.0
WIDE = ["--dim", "4096", "--layers", "8", "--heads", "32", "--hidden", "11008"]


@dataclass(frozen=True)
class Part:
    label: str
    argv: list[str]
    budget: float  # seconds
    soft: bool = False  # gpu_fp8.py: give it --budget (budget - MARGIN)


def parts(smoke: bool) -> list[Part]:
    fp8 = [sys.executable, os.path.join(HERE, "gpu_fp8.py"), "--markdown"] + (["--smoke"] if smoke else [])
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "gpu")]
    contenders = ",".join(dict.fromkeys(["bf16", "tensorwise", "rowwise", CANDIDATE]))
    wide = ",".join(dict.fromkeys(["bf16", "tensorwise", CANDIDATE]))
    if smoke:  # seconds on a loaded 2-core CPU
        return [
            Part("tests/gpu", tests, 60),
            Part("1B model, longer", [*fp8, "--contenders", contenders, "--total", "6"], 90, soft=True),
            Part("width 4096", [*fp8, "--contenders", wide, "--dim", "128", "--heads", "8"], 90, soft=True),
        ]
    return [
        Part("tests/gpu", tests, 60),
        Part("1B model, longer", [*fp8, "--contenders", contenders, "--total", str(LONG_TOTAL)], 300, soft=True),
        Part("width 4096", [*fp8, "--contenders", wide, "--total", str(WIDE_TOTAL), *WIDE], 180, soft=True),
    ]


def run_part(part: Part, budget: float) -> str:
    """Run ``part`` (its output straight through) for at most ``budget`` seconds; one line on how it ended."""
    argv = part.argv + (["--budget", f"{max(1.0, budget - MARGIN):.0f}"] if part.soft else [])
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)  # its own group: stop it and its children
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"[{part.label}] STOPPED at its budget of {budget:.0f} s; the rest of this part is skipped"
    return f"[{part.label}] exit code {rc} after {time.perf_counter() - start:.0f} s (budget {budget:.0f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the same parts, tiny, on the CPU")
    parser.add_argument("--total-budget", type=float, default=540.0, help="seconds for the whole session")
    args = parser.parse_args()
    start = time.perf_counter()
    summary = []
    for part in parts(args.smoke):
        left = args.total_budget - (time.perf_counter() - start)
        if left < MIN_PART:
            summary.append(f"[{part.label}] SKIPPED: {left:.0f} s of the --total-budget left")
        else:
            print(f"\n=== {part.label}: {' '.join(part.argv[1:])} (budget {min(part.budget, left):.0f} s)", flush=True)
            summary.append(run_part(part, min(part.budget, left)))
        print(summary[-1], flush=True)
    print(f"\nsession: {time.perf_counter() - start:.0f} s of {args.total_budget:.0f}")
    for line in summary:
        print("  " + line)
    print(f"command: python benchmarks/gpu_session.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
