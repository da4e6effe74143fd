"""What a mid-epoch resume costs, by position, and what a prepared loader costs per batch.

    python benchmarks/data_resume.py              # rich tables
    python benchmarks/data_resume.py --markdown   # for the README

1. Resume time: a loader of a 100,000-sample epoch (batch 10: 10,000 batches) is stopped at 10% and
   at 90% of the epoch and saved with ``rig.save``; the time measured is ``rig.load`` of that
   checkpoint into a freshly prepared loader plus its first batch (what ``fit(ckpt_path=...)``
   spends on the data before its first resumed step), median of ``--repeats`` loads. Pipelines:
   map-style (shuffled; skipped as indices), a stateful ``IterableDataset`` (its position restored
   through torchdata's StatefulDataLoader), and a stream without a position (read again: the
   contrast). Target: the 90% resume takes at most 1.1x the 10% one.
2. Per-batch overhead: the same shuffled ``DataLoader`` (2 workers, batch 64) iterated by hand and
   prepared by a Rig, paired runs of ``--batches`` batches (wall clock: the work is in the
   workers). Target: at most 1.02x.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, environment_line, print_table, run_paired, table

import torchrig

BATCH = 10


class Stream(IterableDataset[torch.Tensor]):
    """0 .. samples-1 as 1-element tensors; with ``stateful``, its position is its state."""

    def __init__(self, samples: int, stateful: bool) -> None:
        self.samples, self.pos = samples, 0
        if not stateful:
            self.state_dict = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.pos < self.samples:
            self.pos += 1
            yield torch.tensor([float(self.pos - 1)])
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def pipelines(samples: int) -> dict[str, Callable[[], DataLoader[Any]]]:
    data = TensorDataset(torch.arange(float(samples)).unsqueeze(1))
    return {
        "map-style, shuffled": lambda: DataLoader(data, batch_size=BATCH, shuffle=True),
        "iterable, stateful": lambda: DataLoader(Stream(samples, stateful=True), batch_size=BATCH),
        "iterable, no position (replayed)": lambda: DataLoader(Stream(samples, stateful=False), batch_size=BATCH),
    }


def resume_seconds(make: Callable[[], DataLoader[Any]], samples: int, fraction: float, repeats: int) -> float:
    """Median seconds of ``rig.load`` + the first batch, for a checkpoint at ``fraction`` of the epoch."""
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    loader = rig.prepare(make())
    it = iter(loader)
    for _ in range(int(samples // BATCH * fraction)):
        next(it)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        rig.save(Path(tmp) / "ck", {"loader": loader})
        for i in range(repeats + 1):  # the first load warms up (imports, allocator) and is not counted
            resumed = rig.prepare(make())
            start = time.perf_counter()
            rig.load(Path(tmp) / "ck", {"loader": resumed})
            next(iter(resumed))
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead_runners() -> dict[str, Callable[[int], float]]:
    data = TensorDataset(torch.randn(20_000, 32), torch.randn(20_000, 1))
    by_hand = DataLoader(data, batch_size=64, shuffle=True, num_workers=2)
    prepared = torchrig.Rig(accelerator="cpu", devices=1).prepare(
        DataLoader(data, batch_size=64, shuffle=True, num_workers=2)
    )

    def runner(loader: Any) -> Callable[[int], float]:
        def run(batches: int) -> float:
            start = time.perf_counter()
            for i, _ in enumerate(loader):
                if i + 1 == batches:
                    break
            return time.perf_counter() - start

        return run

    return {"DataLoader by hand": runner(by_hand), "rig.prepare(DataLoader)": runner(prepared)}


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--batches", type=int, default=300, help="batches per timed run of the overhead table")
    parser.add_argument("--samples", type=int, default=100_000, help="samples in an epoch of the resume table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # the replayed stream warns, as it should
    print(environment_line("cpu"))
    body = []
    for name, make in pipelines(args.samples).items():
        early, late = (resume_seconds(make, args.samples, f, args.repeats) for f in (0.1, 0.9))
        body.append([name, f"{early * 1e3:,.1f}", f"{late * 1e3:,.1f}", f"{late / early:.2f}x"])
    header = [
        f"pipeline ({args.samples:,} samples, batch {BATCH})",
        "resume at 10% (ms)",
        "resume at 90% (ms)",
        "90% / 10%",
    ]
    print_table("Resume: rig.load + first batch", header, body, markdown=args.markdown)
    results = run_paired(overhead_runners(), steps=args.batches, repeats=args.repeats, warmup=20)
    table(
        "Per-batch cost, 2 workers, batch 64 (wall clock)",
        [(f"{args.batches} batches", results, args.batches)],
        unit="us / batch",
        scale=1e6,
        markdown=args.markdown,
    )


if __name__ == "__main__":
    main()
