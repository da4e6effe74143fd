"""DDP overhead of torchrig: a hand-written DDP loop vs the same loop through ``Rig``.

Both contenders live in the same 2 processes (gloo, CPU), on the same process group, with the
same model, data and batch size, each built once. They then take turns in short blocks of
steps (A B B A A B ...), with a barrier before each block, and each block of the Rig loop is
compared with the hand-written block right next to it: the machine's drift (a shared VM whose
speed swings by tens of percent within seconds) hits both sides of a pair alike. A step is
forward, backward with the gradient all-reduce, optimizer step and data loading; blocks cross
epoch boundaries, so ``set_epoch`` and new iterators are inside the timing too. The table shows
the median and best time per step and the median over pairs of Rig / hand-written, with its
95% confidence interval, in wall time and in this process's CPU time. Target: <= 1.03x, also for
the third contender, the Rig loop that checks ``rig.preempted()`` after every step (an
asynchronous all-reduce of one int per step, see torchrig.preemption).

    python benchmarks/ddp_overhead.py                       # ~40 s
    python benchmarks/ddp_overhead.py --blocks 400 --block-steps 10
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gloo_pair

WORLD = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4096, 256, generator=g), torch.randint(0, 10, (4096,), generator=g))


def _batches(loader: Any) -> Iterator[Any]:
    """Endless batches, epoch after epoch (``set_epoch`` for a DistributedSampler, as a hand-written
    loop does; a prepared loader counts epochs itself)."""
    epoch = 0
    while True:
        if isinstance(getattr(loader, "sampler", None), DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def hand_written(args: argparse.Namespace) -> Callable[[], None]:
    """One step of a plain DDP loop."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = make_data()
    batches = _batches(DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=True, seed=0)))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def through_rig(args: argparse.Namespace, watch_signals: bool = False) -> Callable[[], None]:
    """One step of the same loop prepared by a Rig (ddp strategy, the same process group);
    ``watch_signals``: with the preemption check of docs/rig.md (``rig.preempted()`` every step)."""
    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=WORLD, strategy="ddp")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = rig.prepare(
        model, optimizer, DataLoader(make_data(), batch_size=args.batch, shuffle=True)
    )
    batches = _batches(loader)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def step_watching_signals() -> None:
        step()
        if rig.preempted():
            raise SystemExit("preempted during the benchmark")

    return step_watching_signals if watch_signals else step


def through_rig_watched(args: argparse.Namespace) -> Callable[[], None]:
    return through_rig(args, watch_signals=True)


HAND, RIG, WATCHED = "hand-written DDP", "torchrig Rig (ddp)", "torchrig Rig (ddp) + rig.preempted()"


def main() -> None:
    args = _gloo_pair.parser(__doc__, "batch size per process", blocks=200, block_steps=10, batch=64).parse_args()
    contenders = {HAND: hand_written, RIG: through_rig, WATCHED: through_rig_watched}
    title = f"DDP overhead, {WORLD} processes"
    # warm-up: DDP's first iterations build its buckets
    _gloo_pair.run(contenders, args, world=WORLD, title=title, workload=f"batch {args.batch} per process", warmup=5)


if __name__ == "__main__":
    main()
