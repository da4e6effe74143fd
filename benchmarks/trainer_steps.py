"""The Trainer's cost per step next to the hand-written loop's, alternating step by step in one fit.

``overhead.py`` times whole runs a fraction of a second apart. On this shared VM the speed
drifts between two such runs by several percent, which is as large as the effect being
measured. Here the two alternate at every step inside one ``fit``. A callback, at each training
batch end, runs one step of the hand-written loop of ``overhead.py`` (its own model, optimizer
and DataLoader over the same batches) and reads the clock around it:

- the time inside the callback is the hand-written step; when its loader runs out, the new
  iterator it then starts is included, as in the hand-written loop;
- the time between two calls of the callback is the Trainer's step with everything around it:
  the loop, the other callbacks, ``self.log``, the epoch ends and starts, the progress bar's
  redraws (at its wall-clock rate, and the hand-written steps about double the wall time of a
  fit, so about twice as many per Trainer step as in a real run), and the CSV logger's writes.
  The callback makes the logger write its rows every ``--flush-epochs`` epochs instead of
  every 10 s, so each fit pays for writing its rows inside the measured steps.

Drift hits both sides alike, so the ratio of the sums is stable to about 0.5% between runs. The
first epoch of each fit is not counted (warm-up), nor is its set-up or teardown.

What this does not see, and ``overhead.py`` does: a cost that slows everything in the process
(both sides here), and the difference between running alone and sharing the core's caches with
the other side at every step. The two agree (see ``docs/trainer_tools.md``); read both.

    python benchmarks/trainer_steps.py --rounds 9 --markdown     # about 2 minutes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment_line, median_interval, print_table
from _trainer_contenders import torchrig_fit, torchrig_module
from overhead import LARGE, SMALL, Workload, hand_step

#: name -> which of the default progress bar, CSV logger and checkpointing are on (and the profiler).
CONFIGS: dict[str, dict[str, Any]] = {
    "torchrig Trainer (defaults)": {"bar": True, "logger": True, "checkpointing": True},
    "torchrig Trainer no ckpt": {"bar": True, "logger": True, "checkpointing": False},
    "torchrig Trainer lean": {"bar": False, "logger": False, "checkpointing": False},
    # The defaults with every phase of every step timed (its timed hook wraps this benchmark's
    # callback too, so the row charges the profiler one hook call a step more than a real fit).
    "torchrig Trainer (defaults), simple profiler": {
        "bar": True,
        "logger": True,
        "checkpointing": True,
        "profiler": "simple",
    },
}


def cycling_hand_step(w: Workload) -> Callable[[], None]:
    """One step of ``overhead.py``'s hand-written loop per call, over its own loader, started
    again when it runs out."""
    step, loader = hand_step(w), w.loader()
    batches = iter(loader)

    def next_step() -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        step(x, y)

    return next_step


def one_round(w: Workload, steps: int, flush_epochs: int, config: dict[str, Any]) -> tuple[float, float, int]:
    """One fit of ``steps`` steps; the seconds of the Trainer's and the hand-written steps, and their count."""
    from torchrig.trainer.callbacks import Callback

    hand = cycling_hand_step(w)

    class Alternate(Callback):
        def __init__(self) -> None:
            self.trainer_s = self.hand_s = 0.0
            self.count = 0
            self.last = 0.0

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            epoch = trainer.current_epoch
            if epoch > 1 and (epoch - 1) % flush_epochs == 0:
                for logger in trainer.loggers:
                    logger.flush()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            start = time.perf_counter()
            hand()
            end = time.perf_counter()
            if trainer.current_epoch >= 1:  # the first epoch warms up
                self.trainer_s += start - self.last
                self.hand_s += end - start
                self.count += 1
            self.last = end

    alternate = Alternate()
    torchrig_fit(torchrig_module(w), w.loader(), steps=steps, callbacks=[alternate], **config)
    return alternate.trainer_s, alternate.hand_s, alternate.count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    parser.add_argument("--rounds", type=int, default=9, help="fits per configuration (median of their ratios)")
    parser.add_argument("--steps", type=int, default=1000, help="steps per fit (the first epoch is not counted)")
    parser.add_argument("--flush-epochs", type=int, default=10, help="the logger writes every this many epochs")
    parser.add_argument("--workload", choices=("small", "large"), default="small", help="overhead.py's MLP")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = SMALL if args.workload == "small" else LARGE
    print(environment_line("cpu"))
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    per_step: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
    one_round(w, 2 * w.batches, args.flush_epochs, CONFIGS["torchrig Trainer lean"])  # warm-up
    for _ in range(args.rounds):
        for name, config in CONFIGS.items():  # interleaved: drift between rounds hits every row
            trainer_s, hand_s, n = one_round(w, args.steps, args.flush_epochs, config)
            ratios[name].append(trainer_s / hand_s)
            per_step[name].append((trainer_s / n, hand_s / n))
    title = (
        f"{w.name}: the Trainer's step / the hand-written step, alternating step by step, "
        f"{args.rounds} fits of {args.steps} steps (median, 95% interval)"
    )
    header = ("contender", "Trainer µs/step", "hand-written µs/step", "ratio", "95% interval")
    rows = []
    for name in CONFIGS:
        low_high = median_interval(ratios[name])
        interval = f"{low_high[0]:.3f}-{low_high[1]:.3f}" if low_high else "-"
        trainer_us = statistics.median(t for t, _ in per_step[name]) * 1e6
        hand_us = statistics.median(h for _, h in per_step[name]) * 1e6
        rows.append((name, f"{trainer_us:.1f}", f"{hand_us:.1f}", f"{statistics.median(ratios[name]):.3f}x", interval))
    print_table(title, header, rows, markdown=args.markdown)
    args_line = f"--workload {args.workload} --rounds {args.rounds} --steps {args.steps}"
    args_line += f" --flush-epochs {args.flush_epochs}"
    print(f"\ncommand: python benchmarks/trainer_steps.py {args_line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
