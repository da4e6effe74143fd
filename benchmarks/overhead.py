"""What a training step costs through each API, next to the same loop written by hand.

    python benchmarks/overhead.py              # rich table
    python benchmarks/overhead.py --markdown   # for the README
    python benchmarks/overhead.py --suite trainers --workload small --only torchrig --repeats 161
    python benchmarks/overhead.py --suite trainer-parts --workload small --repeats 81

Two workloads: a small MLP whose step is dominated by Python overhead (where a wrapper's cost
shows), and a larger one whose step is dominated by matmuls. Every contender runs the same
loop (forward, cross-entropy, backward, step, zero_grad) over the same cheap DataLoader of
ready-made batches, with the same initial weights, on one CPU thread. Each run of a contender
is paired with a run of the hand-written loop right next to it (``_common.run_paired``); the
ratio is the median of the paired ratios, with its 95% confidence interval. Contenders whose
package is not installed are listed as such.

To add a contender (say a Trainer), write ``def my_contender(w: Workload) -> Runner`` that
builds its model with :meth:`Workload.model` and returns a function running ``steps`` steps
and returning the seconds they took, then add it to :data:`CONTENDERS`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Runner, base_parser, clock, environment_line, run_paired, table
from _trainer_contenders import TRAINER_CONTENDERS, TRAINER_PARTS


@dataclass(frozen=True)
class Workload:
    name: str
    features: int
    hidden: int
    classes: int
    batch: int
    steps: int  # per repeat; a multiple of ``batches``
    batches: int = 50  # batches in the loader (one "epoch")

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(self.features, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.classes),
        )

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01)

    def loader(self) -> DataLoader[Any]:
        # Ready-made batches (batch_size=None): the loader itself costs next to nothing, so what
        # is measured is the step and the wrappers around it.
        g = torch.Generator().manual_seed(1)
        data = [
            (torch.randn(self.batch, self.features, generator=g), torch.randint(0, self.classes, (self.batch,)))
            for _ in range(self.batches)
        ]
        return DataLoader(data, batch_size=None)  # type: ignore[arg-type]


# Short runs (~0.1-0.4 s), many pairs: the baseline run next to each is then close in time.
SMALL = Workload("small MLP 32-64-64-10, batch 32", features=32, hidden=64, classes=10, batch=32, steps=250)
LARGE = Workload(
    "large MLP 256-1024-1024-10, batch 128", features=256, hidden=1024, classes=10, batch=128, steps=40, batches=10
)


def _timed_loop(w: Workload, loader: Any, one_step: Callable[[Any, Any], None]) -> Runner:
    def run(steps: int) -> float:
        start = clock()
        for _ in range(max(1, steps // w.batches)):
            for x, y in loader:
                one_step(x, y)
        return clock() - start

    return run


def hand_step(w: Workload) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One step of the hand-written loop (its own model and optimizer) per call."""
    device = torch.device("cpu")
    model = w.model().to(device)
    optimizer = w.optimizer(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def hand_written(w: Workload) -> Runner:
    return _timed_loop(w, w.loader(), hand_step(w))


def torchrig_rig(w: Workload) -> Runner:
    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=1, precision="32-true")
    model = w.model()
    model, optimizer, loader = rig.prepare(model, w.optimizer(model), w.loader())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return _timed_loop(w, loader, step)


def lightning_fabric(w: Workload) -> Runner:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = w.model()
    model, optimizer = fabric.setup(model, w.optimizer(model))
    loader = fabric.setup_dataloaders(w.loader())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return _timed_loop(w, loader, step)


def hf_accelerate(w: Workload) -> Runner:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="no")
    model = w.model()
    model, optimizer, loader = accelerator.prepare(model, w.optimizer(model), w.loader())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return _timed_loop(w, loader, step)


#: name -> contender; the first is the baseline every ratio is taken against.
CONTENDERS: dict[str, Callable[[Workload], Runner]] = {
    "hand-written": hand_written,
    "torchrig Rig": torchrig_rig,
    "Lightning Fabric": lightning_fabric,
    "HF Accelerate": hf_accelerate,
}


def build(w: Workload, contenders: dict[str, Callable[[Workload], Runner]] | None = None) -> dict[str, Runner | str]:
    runners: dict[str, Runner | str] = {}
    for name, contender in (CONTENDERS if contenders is None else contenders).items():
        try:
            runners[name] = contender(w)
        except ImportError:
            runners[name] = "not installed"
    return runners


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the steps per repeat")
    parser.add_argument(
        "--suite",
        choices=("loops", "trainers", "trainer-parts", "all"),
        default="all",
        help="which table(s) to time (all: loops and trainers)",
    )
    parser.add_argument("--workload", choices=("small", "large", "both"), default="both", help="which MLP(s)")
    parser.add_argument(
        "--only", metavar="TEXT", help="time only the contenders whose name contains TEXT (and the hand-written loop)"
    )
    parser.set_defaults(repeats=21)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    suites = {
        "loops": ("Training step", CONTENDERS),
        # Trainers: fit() per step (hooks, logging, bar, checkpoint checks; one-time set-up and teardown
        # left out, the same for every Trainer), see _trainer_contenders.
        "trainers": ("Trainer.fit, per step", {"hand-written": hand_written, **TRAINER_CONTENDERS}),
        "trainer-parts": ("Our Trainer's defaults one by one", {"hand-written": hand_written, **TRAINER_PARTS}),
    }
    print(environment_line("cpu"))
    for key, (label, contenders) in suites.items():
        if args.suite != key and not (args.suite == "all" and key != "trainer-parts"):
            continue
        if args.only:
            contenders = {k: v for k, v in contenders.items() if k == "hand-written" or args.only in k}
        rows = []
        for w in {"small": (SMALL,), "large": (LARGE,), "both": (SMALL, LARGE)}[args.workload]:
            # Whole epochs, at least 4 (the Trainer contenders time the epochs between the first and last).
            steps = max(4 * w.batches, int(w.steps * args.scale) // w.batches * w.batches)
            results = run_paired(build(w, contenders), steps=steps, repeats=args.repeats, warmup=4 * w.batches)
            rows.append((w.name, results, steps))
        title = f"{label}, {args.repeats} paired repeats (lower is better)"
        table(title, rows, unit="µs/step", scale=1e6, markdown=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
