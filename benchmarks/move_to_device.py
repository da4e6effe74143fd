"""Moving a nested batch to the device: torchrig vs Lightning and Accelerate.

    python benchmarks/move_to_device.py              # rich table
    python benchmarks/move_to_device.py --markdown   # for the README

The batch is a dict of 64 small tensors spread over lists, tuples and nested dicts (with a few
non-tensor leaves), moved to the device the run computes on. On a CPU-only machine that is
CPU -> CPU, so what is measured is the traversal and the per-tensor checks each library pays
on every batch; on a GPU the copies themselves are added equally for everyone. Lightning's
``move_data_to_device`` and Accelerate's ``send_to_device`` are measured when installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Runner, base_parser, clock, environment_line, run_interleaved, table


def nested_batch(n_tensors: int = 64) -> dict[str, Any]:
    """A dict of ``n_tensors`` tensors in lists, tuples and nested dicts, plus non-tensor leaves."""
    g = torch.Generator().manual_seed(0)
    per_key = 8
    batch: dict[str, Any] = {"ids": ["a", "b"], "step": 3}
    for k in range(n_tensors // per_key):
        tensors = [torch.randn(4, 8, generator=g) for _ in range(per_key)]
        batch[f"group{k}"] = {
            "list": tensors[:3],
            "tuple": tuple(tensors[3:6]),
            "nested": {"a": tensors[6], "b": [tensors[7]]},
        }
    return batch


def _timed(fn: Callable[[Any, torch.device], Any], batch: Any, device: torch.device) -> Runner:
    def run(steps: int) -> float:
        start = clock()
        for _ in range(steps):
            fn(batch, device)
        return clock() - start

    return run


def torchrig_move(batch: Any, device: torch.device) -> Runner:
    from torchrig import move_to_device

    return _timed(move_to_device, batch, device)


def lightning_move(batch: Any, device: torch.device) -> Runner:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return _timed(move_data_to_device, batch, device)


def accelerate_send(batch: Any, device: torch.device) -> Runner:
    from accelerate.utils import send_to_device

    return _timed(send_to_device, batch, device)


#: name -> contender; the first is the baseline every ratio is taken against.
CONTENDERS: dict[str, Callable[[Any, torch.device], Runner]] = {
    "torchrig move_to_device": torchrig_move,
    "Lightning move_data_to_device": lightning_move,
    "Accelerate send_to_device": accelerate_send,
}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="moves per repeat")
    parser.add_argument("--device", default=None, help="target device (default: the accelerator, else cpu)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = torch.device(args.device or (accel.type if accel is not None else "cpu"))
    batch = nested_batch()
    runners: dict[str, Runner | str] = {}
    for name, contender in CONTENDERS.items():
        try:
            runners[name] = contender(batch, device)
        except ImportError:
            runners[name] = "not installed"
    results = run_interleaved(runners, steps=args.steps, repeats=args.repeats, warmup=args.steps // 10)
    print(environment_line(f"cpu -> {device}"))
    title = f"Moving a dict of 64 nested tensors, median of {args.repeats} interleaved repeats (lower is better)"
    table(
        title,
        [(f"64 tensors, cpu -> {device}", results, args.steps)],
        unit="µs/batch",
        scale=1e6,
        markdown=args.markdown,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
