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
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gloo_pair

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


def hand_written(args: argparse.Namespace) -> Callable[[], None]:
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
    batches = _batches(DataLoader(make_data(), batch_size=args.batch, shuffle=True, generator=g))

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def through_rig(args: argparse.Namespace) -> Callable[[], None]:
    """One step of the same loop prepared by a Rig with ModelParallelStrategy (the same process group)."""
    import torchrig

    strategy = torchrig.ModelParallelStrategy(tensor_parallel=WORLD)
    rig = torchrig.Rig(accelerator="cpu", devices=WORLD, strategy=strategy)
    model = rig.prepare(make_model())
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = _batches(rig.prepare(DataLoader(make_data(), batch_size=args.batch, shuffle=True)))

    def step() -> None:
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


HAND, RIG = "hand-written parallelize_module", "torchrig Rig (ModelParallelStrategy, tp=2)"


def main() -> None:
    args = _gloo_pair.parser(__doc__, "batch size (the same batch on both tp ranks)").parse_args()
    contenders = {HAND: hand_written, RIG: through_rig}
    title = f"Tensor-parallel overhead, {WORLD} processes (tp={WORLD})"
    _gloo_pair.run(contenders, args, world=WORLD, title=title, workload=f"batch {args.batch} x {SEQ} tokens")


if __name__ == "__main__":
    main()
