"""Trainer overhead counted in CPU instructions (valgrind callgrind): a repeatable number.

Wall and CPU time on a shared VM swing by 10-60% between identical runs, too much to judge a
10% target. Instruction counts do not depend on the neighbours. Each contender runs in its own
process twice, for ``--steps`` and ``4 * --steps`` optimizer steps; the difference divided by
the extra steps is the cost of one step, with imports and set-up cancelled out. Contenders:
the hand-written loop, our Trainer lean (bar, logger, checkpointing off) and our Trainer with
its defaults minus the progress bar (CSV logging of the loss every step, default
checkpointing), and each of the two Trainers with ``profiler="simple"`` (what the profiler
adds to a step). The progress bar is left out because it redraws on a wall-clock timer (every
0.5 s): under valgrind, which runs ~50x slower, it would redraw ~50x more often per step than
in a real run. The defaults' logger flushes and checkpoint saves are on wall-clock timers too,
so their count differs between two runs by a percent or two; the lean contenders are exact.
Instructions are not time (cache misses and branch mispredictions differ), so read this beside
``overhead.py``, not instead of it.

    python benchmarks/trainer_instructions.py            # about 25 minutes on 2 cores
    python benchmarks/trainer_instructions.py --modes lean lean_profiler   # the profiler's cost
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MODES = {
    "hand": "hand-written loop",
    "lean": "torchrig Trainer lean",
    "nobar": "torchrig Trainer, defaults but no bar",
    "profiler": "torchrig Trainer, defaults but no bar, simple profiler",
    "lean_profiler": "torchrig Trainer lean, simple profiler",
}


def worker(mode: str, steps: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from torchrig import Trainer, TrainingModule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1600, 32), torch.randint(0, 10, (1600,)))

    def model() -> nn.Module:  # the small MLP of overhead.py
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    if mode == "hand":
        net, done = model(), 0
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        while done < steps:
            for x, y in DataLoader(data, batch_size=32, shuffle=True):
                loss = F.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                done += 1
                if done == steps:
                    break
        return

    class Module(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.01)

    root = tempfile.mkdtemp(prefix="torchrig-instr-")
    try:
        lean = mode in ("lean", "lean_profiler")
        off: dict[str, Any] = {"logger": False, "enable_checkpointing": False} if lean else {}
        if mode in ("profiler", "lean_profiler"):
            off["profiler"] = "simple"
        trainer = Trainer(
            accelerator="cpu",
            max_steps=steps,
            log_every_n_steps=1,
            default_root_dir=root,
            enable_progress_bar=False,
            **off,
        )
        trainer.fit(Module(), DataLoader(data, batch_size=32, shuffle=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def count(mode: str, steps: int) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__]
    proc = subprocess.run([*cmd, "--worker", mode, str(steps)], capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{mode} {steps}: valgrind failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="the short run; the long run is 4x")
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the contenders (default: all)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    modes = {m: MODES[m] for m in args.modes}
    jobs = [(m, n) for m in modes for n in (args.steps, 4 * args.steps)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job), jobs), strict=True))
    per_step = {m: (counts[(m, 4 * args.steps)] - counts[(m, args.steps)]) / (3 * args.steps) for m in modes}
    base = "hand" if "hand" in per_step else next(iter(per_step))
    print(f"| contender | instructions/step | vs {modes[base]} |\n|---|--:|--:|")
    for mode, label in modes.items():
        print(f"| {label} | {per_step[mode]:,.0f} | {per_step[mode] / per_step[base]:.3f}x |")
    print(f"\ncommand: python benchmarks/trainer_instructions.py --steps {args.steps} --modes {' '.join(modes)}")


if __name__ == "__main__":
    main()
