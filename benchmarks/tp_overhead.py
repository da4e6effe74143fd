"""Tensor-parallel overhead of torchrig: a hand-written ``parallelize_module`` + DTensor loop vs ``Rig``.

Both contenders live in the same 2 processes (gloo, CPU), on the same process group, with the
same transformer (``torchrig.demo.transformer.Transformer``, Megatron-style plan: attention and
MLP split by columns then rows, embedding by rows, head by columns), the same data and batch,
each built once. The hand-written loop builds its own 1-D ``tp`` mesh and calls
``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``; the Rig loop uses
``ModelParallelStrategy(tensor_parallel=2)`` (mesh ``dp_replicate=1 x dp_shard=1 x tp=2``, the
plan from the model's ``_tp_plan``; with one data-parallel rank nothing is FSDP-sharded).
They take turns in short blocks of steps (A B B A ...), with a barrier before each block, and
each Rig block is compared with the hand-written block next to it, as ``ddp_overhead.py`` does.
A step is data loading, forward, cross-entropy, backward, AdamW step. Target: <= 1.03x.

    python benchmarks/tp_overhead.py                       # ~1 min
    python benchmarks/tp_overhead.py --blocks 200 --block-steps 5
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
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_interval

WORLD = 2
SEQ = 32
VOCAB = 512


def make_model() -> nn.Module:
    from torchrig.demo.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=128, layers=2, heads=4)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1024, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def hand_written(batch: int) -> Callable[[], None]:
    """One step of a tensor-parallel loop written with parallelize_module (both ranks read the same batches)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    model = make_model()
    plan: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):  # type: ignore[arg-type]
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)  # the same shuffle on both ranks
    batches = _batches(DataLoader(make_data(), batch_size=batch, shuffle=True, generator=g))

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def through_rig(batch: int) -> Callable[[], None]:
    """One step of the same loop prepared by a Rig with ModelParallelStrategy (the same process group)."""
    import torchrig

    strategy = torchrig.ModelParallelStrategy(tensor_parallel=WORLD)
    rig = torchrig.Rig(accelerator="cpu", devices=WORLD, strategy=strategy)
    model = rig.prepare(make_model())
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = _batches(rig.prepare(DataLoader(make_data(), batch_size=batch, shuffle=True)))

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


HAND, RIG = "hand-written parallelize_module", "torchrig Rig (ModelParallelStrategy, tp=2)"


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    steps = {HAND: hand_written(args.batch), RIG: through_rig(args.batch)}
    for step in steps.values():
        for _ in range(3):
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
    def paired(times: dict[str, list[float]]) -> str:
        ratios = [r / h for r, h in zip(times[RIG], times[HAND], strict=True)]
        lo, hi = median_interval(ratios) or (float("nan"), float("nan"))
        return f"{statistics.median(ratios):.3f}x ({lo:.3f}-{hi:.3f})"

    print(f"\nTensor-parallel overhead, {WORLD} processes (tp={WORLD}), gloo on CPU, torch {torch.__version__}")
    print(f"{args.blocks} blocks x {args.block_steps} steps per contender, batch {args.batch} x {SEQ} tokens\n")
    print("| contender | median ms/step | best ms/step | paired ratio, wall (95% CI) | paired ratio, CPU (95% CI) |")
    print("|---|--:|--:|--:|--:|")
    for name in wall:
        ratios = ("1.000x", "1.000x") if name == HAND else (paired(wall), paired(cpu))
        med, best = statistics.median(wall[name]) * 1e3, min(wall[name]) * 1e3
        print(f"| {name} | {med:.3f} | {best:.3f} | {ratios[0]} | {ratios[1]} |")
    print(f"\ncommand: python {' '.join(sys.argv)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100, help="blocks per contender (each paired with a neighbour)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block")
    parser.add_argument("--batch", type=int, default=8, help="batch size (the same batch on both tp ranks)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from torchrig.strategies.launch import find_free_port

    mp.start_processes(worker, args=(args, find_free_port()), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
