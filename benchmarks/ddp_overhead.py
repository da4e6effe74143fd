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
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_interval

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


def hand_written(batch: int) -> Callable[[], None]:
    """One step of a plain DDP loop."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = make_data()
    batches = _batches(DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0)))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def through_rig(batch: int, watch_signals: bool = False) -> Callable[[], None]:
    """One step of the same loop prepared by a Rig (ddp strategy, the same process group);
    ``watch_signals``: with the preemption check of docs/rig.md (``rig.preempted()`` every step)."""
    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=WORLD, strategy="ddp")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = rig.prepare(model, optimizer, DataLoader(make_data(), batch_size=batch, shuffle=True))
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


HAND, RIG, WATCHED = "hand-written DDP", "torchrig Rig (ddp)", "torchrig Rig (ddp) + rig.preempted()"


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    steps = {HAND: hand_written(args.batch), RIG: through_rig(args.batch), WATCHED: through_rig(args.batch, True)}
    for step in steps.values():  # warm-up: DDP's first iterations build its buckets
        for _ in range(5):
            step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for block in range(args.blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            step = steps[name]
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            for _ in range(args.block_steps):
                step()
            wall[name].append((time.perf_counter() - w) / args.block_steps)
            cpu[name].append((time.process_time() - c) / args.block_steps)
    if rank == 0:
        report(wall, cpu, args)
    dist.barrier()
    dist.destroy_process_group()


def report(wall: dict[str, list[float]], cpu: dict[str, list[float]], args: argparse.Namespace) -> None:
    hand = HAND

    def paired(times: dict[str, list[float]], name: str) -> str:
        ratios = [r / h for r, h in zip(times[name], times[hand], strict=True)]
        lo, hi = median_interval(ratios) or (float("nan"), float("nan"))
        return f"{statistics.median(ratios):.3f}x ({lo:.3f}-{hi:.3f})"

    print(f"\nDDP overhead, {WORLD} processes, gloo on CPU, torch {torch.__version__}")
    print(f"{args.blocks} blocks x {args.block_steps} steps per contender, batch {args.batch} per process\n")
    print("| contender | median ms/step | best ms/step | paired ratio, wall (95% CI) | paired ratio, CPU (95% CI) |")
    print("|---|--:|--:|--:|--:|")
    for name in wall:
        ratios = ("1.000x", "1.000x") if name == hand else (paired(wall, name), paired(cpu, name))
        med, best = statistics.median(wall[name]) * 1e3, min(wall[name]) * 1e3
        print(f"| {name} | {med:.3f} | {best:.3f} | {ratios[0]} | {ratios[1]} |")
    print(f"\ncommand: python {' '.join(sys.argv)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=200, help="blocks per contender (each paired with a neighbour)")
    parser.add_argument("--block-steps", type=int, default=10, help="steps per block")
    parser.add_argument("--batch", type=int, default=64, help="batch size per process")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from torchrig.strategies.launch import find_free_port

    mp.start_processes(worker, args=(args, find_free_port()), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
