"""``torchrig demo``: watch a small CNN learn handwritten digits on the best hardware this machine has."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrig.demo.run import DemoResult

DEFAULT_ROOT = "runs/demo"
DEFAULT_EPOCHS = 10


def _devices(value: str) -> int | str:
    """``"2"`` -> 2 and ``"-1"`` -> -1; ``"0,1"`` and ``"auto"`` stay strings."""
    return int(value) if re.fullmatch(r"-?\d+", value.strip()) else value


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's handwritten digits with the Trainer (needs scikit-learn, matplotlib)",
        description="Train a small convolutional network on the 1,797 handwritten digits that ship with "
        "scikit-learn (nothing is downloaded), validating each epoch and testing on a held-out split at the "
        "end. Writes a run directory (checkpoint, metrics.csv, learning_curves.png) under --root-dir. "
        "Needs scikit-learn and matplotlib: pip install scikit-learn matplotlib (in a clone of torchrig: "
        "pip install -e '.[demo]').",
    )
    p.add_argument("--accelerator", default="auto", help="auto, cpu, cuda, gpu, mps, xpu, tpu or a registered name")
    p.add_argument(
        "--devices", type=_devices, default=1, help="devices (processes on the CPU): 1, 2, '0,1', -1 for all"
    )
    p.add_argument("--strategy", default="auto", help="auto, single, ddp, ddp_spawn, fsdp ...")
    p.add_argument(
        "--precision",
        default="auto",
        help="auto (bf16-mixed where the device has bf16, else 32-true; with --resume, the checkpoint's), "
        "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true",
    )
    p.add_argument("--max-epochs", type=int, default=DEFAULT_EPOCHS, help=f"epochs to train (default {DEFAULT_EPOCHS})")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest run under --root-dir from its last checkpoint, in its precision (raise "
        "--max-epochs to train longer: the learning-rate cosine is re-planned over the new --max-epochs)",
    )
    p.add_argument("--root-dir", default=DEFAULT_ROOT, help=f"where runs are written (default {DEFAULT_ROOT})")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the shuffling (default 0)")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    started = _process_start()
    from torchrig.demo import MissingExtraError, require_extras

    try:
        require_extras()
    except MissingExtraError as err:
        print(f"torchrig demo: {err}", file=sys.stderr)
        return 2
    from torchrig.demo.run import run_demo

    try:
        result = run_demo(
            accelerator=args.accelerator,
            devices=args.devices,
            strategy=args.strategy,
            precision=args.precision,
            max_epochs=args.max_epochs,
            root_dir=args.root_dir,
            resume=args.resume,
            seed=args.seed,
            started=started,
        )
    except (ValueError, TypeError) as err:  # bad options: resolve() and the Trainer say what to change
        print(f"torchrig demo: {err}", file=sys.stderr)
        return 2
    if result is not None:
        print_summary(result)
    return 0


def _process_start() -> float:
    """When this process started, on the ``time.perf_counter`` clock (so the time printed includes
    the interpreter and the imports, as ``time torchrig demo`` measures it)."""
    import psutil

    age = time.time() - psutil.Process().create_time()
    return time.perf_counter() - max(age, 0.0)


def _what_was_trained(result: DemoResult) -> str:
    first, last, seconds = result.first_epoch, result.epochs, result.fit_seconds
    if first is None and result.spawned:
        return f"trained up to epoch {last - 1} in {result.processes} worker processes in {seconds:.1f} s"
    if first is None:
        return f"no epoch trained: the run already has {last}; raise --max-epochs to train more"
    if first == 0:
        return f"{last} epoch{'' if last == 1 else 's'} trained in {seconds:.1f} s"
    epochs = f"epoch {first}" if first + 1 == last else f"epochs {first}-{last - 1}"  # counted from 0, as the bar
    return f"resumed: {epochs} trained in {seconds:.1f} s"


def print_summary(result: DemoResult) -> None:
    """The lines a newcomer looks for: where it ran, how well, how fast, and where the files are."""
    print()
    layout = f"{result.processes} processes, {result.strategy}" if result.processes > 1 else "1 process"
    print(f"device:        {result.device} ({layout})")
    print(f"precision:     {result.precision}")
    held_out = f"test loss {result.test_loss:.4f}, {result.test_images} held-out images"
    print(f"test accuracy: {result.test_accuracy:.2%} ({held_out})")
    trained = _what_was_trained(result)
    print(f"time:          {result.total_seconds:.1f} s since the command started ({trained})")
    print(f"run directory: {result.run_dir}")
    print(f"  checkpoint:  {result.run_dir / 'checkpoints' / 'last'}")
    print(f"  metrics:     {result.run_dir / 'metrics.csv'}")
    if result.png is not None:
        print(f"  curves:      {result.png}")
