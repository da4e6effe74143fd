"""Two contenders in the same gloo processes, taking turns in blocks of steps: the shared runner of
``tp_overhead.py`` and ``pp_overhead.py``.

Each process builds both contenders once (on the same process group), warms them up, then runs
them in alternating blocks (A B B A ...), with a barrier before each block; each block of the
second contender is compared with the block of the first next to it (paired ratios, median and
95% interval), as ``ddp_overhead.py`` does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_interval

#: Builds one contender's step in a process of the group (called with the parsed arguments).
Contender = Callable[[argparse.Namespace], Callable[[], None]]


def parser(
    description: str | None, batch_help: str, *, blocks: int = 100, block_steps: int = 5, batch: int = 8
) -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--blocks", type=int, default=blocks, help="blocks per contender (each paired with a neighbour)")
    out.add_argument("--block-steps", type=int, default=block_steps, help="steps per block")
    out.add_argument("--batch", type=int, default=batch, help=batch_help)
    return out


def run(
    contenders: dict[str, Contender],
    args: argparse.Namespace,
    *,
    world: int,
    title: str,
    workload: str,
    warmup: int = 3,
) -> None:
    """Spawn ``world`` processes that time ``contenders`` (the first is the baseline) after ``warmup``
    steps each; rank 0 prints the table."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from torchrig.strategies.launch import find_free_port

    spec = (contenders, args, world, title, workload, warmup)
    mp.start_processes(_worker, args=(spec, find_free_port()), nprocs=world, start_method="spawn")


def _worker(rank: int, spec: tuple[Any, ...], port: int) -> None:
    contenders, args, world, title, workload, warmup = spec
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    steps = {name: build(args) for name, build in contenders.items()}
    for step in steps.values():
        for _ in range(warmup):
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
        _report(wall, cpu, args, title, workload)
    dist.barrier()
    dist.destroy_process_group()


def _report(
    wall: dict[str, list[float]], cpu: dict[str, list[float]], args: argparse.Namespace, title: str, workload: str
) -> None:
    base = next(iter(wall))

    def paired(times: dict[str, list[float]], name: str) -> str:
        ratios = [r / h for r, h in zip(times[name], times[base], strict=True)]
        lo, hi = median_interval(ratios) or (float("nan"), float("nan"))
        return f"{statistics.median(ratios):.3f}x ({lo:.3f}-{hi:.3f})"

    print(f"\n{title}, gloo on CPU, torch {torch.__version__}")
    print(f"{args.blocks} blocks x {args.block_steps} steps per contender, {workload}\n")
    print("| contender | median ms/step | best ms/step | paired ratio, wall (95% CI) | paired ratio, CPU (95% CI) |")
    print("|---|--:|--:|--:|--:|")
    for name in wall:
        ratios = ("1.000x", "1.000x") if name == base else (paired(wall, name), paired(cpu, name))
        med, best = statistics.median(wall[name]) * 1e3, min(wall[name]) * 1e3
        print(f"| {name} | {med:.3f} | {best:.3f} | {ratios[0]} | {ratios[1]} |")
    print(f"\ncommand: python {' '.join(sys.argv)}")
