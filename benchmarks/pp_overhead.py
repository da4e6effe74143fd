"""Pipeline-parallel overhead of torchrig: a hand-written ``torch.distributed.pipelining`` loop vs ``Rig``.

Both contenders live in the same 2 processes (gloo, CPU), on the same process group, with the
same transformer (``torchrig.demo.transformer.Transformer``, 4 blocks: 2 per stage), the same
data, batch and schedule (``Schedule1F1B``, 4 microbatches), each built once. The hand-written
loop cuts the model itself (rank 0 keeps the embedding and blocks 0-1, rank 1 blocks 2-3, the
norm and the head), wraps it in a ``PipelineStage`` and calls ``schedule.step``; the Rig loop uses
``ModelParallelStrategy(pipeline_parallel=2)`` and ``rig.forward_backward`` (which also
broadcasts the loss from the last stage, so every rank has it). A step is data loading, the
schedule's forwards and backwards, AdamW step. They take turns in short blocks of steps
(``_gloo_pair.py``). Target: <= 1.03x.

    python benchmarks/pp_overhead.py                       # ~1 min
    python benchmarks/pp_overhead.py --blocks 200 --block-steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gloo_pair
from tp_overhead import SEQ, VOCAB, _batches, make_data  # the same data as the tensor-parallel benchmark

WORLD = 2
MICROBATCHES = 4


def make_model() -> nn.Module:
    from torchrig.demo.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=128, layers=4, heads=4)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def hand_written(args: argparse.Namespace) -> Callable[[], None]:
    """One step of a 1F1B pipeline written with torch.distributed.pipelining (both ranks read the same batches)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    model: Any = make_model()
    if rank == 0:
        del model.layers[2:]
        model.norm, model.head = nn.Identity(), nn.Identity()
    else:
        del model.layers[:2]
        model.tok = nn.Identity()
    stage = PipelineStage(model, rank, WORLD, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)  # the same shuffle on both ranks
    batches = _batches(DataLoader(make_data(), batch_size=args.batch, shuffle=True, generator=g))

    def step() -> None:
        x, y = next(batches)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad()

    return step


def through_rig(args: argparse.Namespace) -> Callable[[], None]:
    """One step of the same pipeline prepared by a Rig with ModelParallelStrategy (the same process group)."""
    import torchrig

    strategy = torchrig.ModelParallelStrategy(pipeline_parallel=WORLD, pp_schedule="1F1B", pp_microbatches=MICROBATCHES)
    rig = torchrig.Rig(accelerator="cpu", devices=WORLD, strategy=strategy)
    model = rig.prepare(make_model())
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = _batches(rig.prepare(DataLoader(make_data(), batch_size=args.batch, shuffle=True)))

    def step() -> None:
        x, y = next(batches)
        rig.forward_backward(model, next_token_loss, x, target=y)
        optimizer.step()
        optimizer.zero_grad()

    return step


HAND, RIG = "hand-written torch.distributed.pipelining", "torchrig Rig (ModelParallelStrategy, pp=2)"


def main() -> None:
    args = _gloo_pair.parser(__doc__, "batch size (split into 4 microbatches)").parse_args()
    title = f"Pipeline-parallel overhead, {WORLD} processes (pp={WORLD}, Schedule1F1B, {MICROBATCHES} microbatches)"
    workload = f"batch {args.batch} x {SEQ} tokens"
    _gloo_pair.run({HAND: hand_written, RIG: through_rig}, args, world=WORLD, title=title, workload=workload)


if __name__ == "__main__":
    main()
