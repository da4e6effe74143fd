"""A tiny transformer trained under ModelParallelStrategy (or DDP/FSDP), for the N-D parallel tests.

    python model_parallel.py --out W.pt --devices 4 --replicate 1 --shard 2 --tp 2 [--empty-init]
        [--strategy ddp|fsdp] [--save DIR] [--load DIR] [--steps 3] [--sequence-parallel]
        [--pp 2 --schedule 1F1B --split layers.1] [--layers 4] [--llama]

Rank 0 writes the full final weights to ``--out`` and, next to it (``.json``), the losses, the
clipped gradient norms and how many parameter elements it holds. ``--load`` starts from a
checkpoint (model, optimizer and dataloader position); ``--save`` writes one after training. Importable for the
one-process reference (``train``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.demo.transformer import Block, Transformer, tiny

GLOBAL_BATCH = 8
SEQ = 8
MAX_NORM = 0.5

#: Megatron-style sequence parallel: between the split matmuls the activations (and the norms'
#: work) are split along the sequence; each split layer gathers them on the way in.
SEQUENCE_PARALLEL_PLAN = {
    "tok": "rowwise_seq",
    "layers.*.norm1": "sequence",
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise_seq",
    "layers.*.norm2": "sequence",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise_seq",
    "norm": "sequence",
    "head": "colwise_rep",
}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, 64, (4 * GLOBAL_BATCH, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_model(layers: int = 2, llama: bool = False) -> nn.Module:
    """The demo transformer (``tiny()`` for 2 layers), or a tiny transformers ``LlamaForCausalLM``."""
    if llama:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            use_cache=False,
        )
        return LlamaForCausalLM(config)
    return tiny() if layers == 2 else Transformer(vocab=64, dim=32, layers=layers, heads=4)


def reference_init(layers: int = 2, llama: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return make_model(layers, llama).state_dict()


def next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def half_next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Half the loss of a batch: two of them accumulate one step's gradients (``--accumulate``)."""
    return next_token_loss(output, target) / 2


def train(
    rig: torchrig.Rig,
    *,
    steps: int = 3,
    empty_init: bool = False,
    load: str | None = None,
    save: str | None = None,
    layers: int = 2,
    llama: bool = False,
    accumulate: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``steps`` AdamW steps clipped to ``MAX_NORM``; the full final weights (rank 0) and a report.
    ``accumulate``: each step's gradients accumulated from two halves of its batch."""
    rig.seed_everything(7)
    with rig.init_module(empty_init=empty_init):
        model = make_model(layers, llama)
    if not empty_init:
        model.load_state_dict(reference_init(layers, llama))
    model = rig.prepare(model)
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = rig.prepare(DataLoader(dataset(), batch_size=GLOBAL_BATCH // rig.strategy.data_parallel_size))
    state = {"model": model, "optimizer": optimizer, "data": loader}
    if load:
        rig.load(load, state)
    losses, norms = [], []
    batches = iter(loader)
    for _ in range(steps):  # exactly ``steps`` batches drawn: the saved position is mid-epoch
        x, y = next(batches)
        if accumulate:
            halves = zip(x.chunk(2), y.chunk(2), strict=True)
            loss = sum(rig.forward_backward(model, half_next_token_loss, a, target=b) for a, b in halves)
        else:
            loss = rig.forward_backward(model, next_token_loss, x, target=y)
        norms.append(rig.clip_gradients(model, optimizer, max_norm=MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(rig.all_reduce(loss, "mean"))
    if save:
        rig.save(save, state)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    report = {
        "losses": [float(v) for v in losses],
        "norms": [float(v) for v in norms],
        "local_numel": local,
        "world_size": rig.world_size,
        "samples_seen": loader.state_dict()["samples_seen"],  # global samples of the epoch consumed
        "loader_replicas": loader.state_dict()["num_replicas"],  # the data-parallel ranks, not the world
        "strategy": type(rig.strategy).__name__,
        "fsdp": any(type(m).__name__.startswith("FSDP") for m in model.modules()),
        "finite": all(
            bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all()) for p in model.parameters()
        ),
    }
    return rig.strategy.module_state_dict(model), report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--strategy", default="model_parallel")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--shard", default="auto")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true", help="train with SEQUENCE_PARALLEL_PLAN")
    parser.add_argument("--empty-init", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--split", nargs="*", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--llama", action="store_true", help="a tiny transformers LlamaForCausalLM")
    parser.add_argument("--accumulate", action="store_true", help="each step from two halves of its batch")
    args = parser.parse_args()
    strategy: Any = args.strategy
    if strategy == "model_parallel":
        strategy = torchrig.ModelParallelStrategy(
            pipeline_parallel=args.pp,
            pp_schedule=args.schedule,
            pp_split=args.split,
            data_parallel_replicate=args.replicate,
            data_parallel_shard=args.shard if args.shard == "auto" else int(args.shard),
            tensor_parallel=args.tp,
            tp_plan=SEQUENCE_PARALLEL_PLAN if args.sequence_parallel else None,
            auto_wrap_policy=None if args.llama else {Block},
        )
    elif strategy == "fsdp":
        strategy = torchrig.FSDPStrategy(auto_wrap_policy={Block})
    rig = torchrig.Rig(accelerator="cpu", devices=args.devices, strategy=strategy)
    state, report = train(
        rig,
        steps=args.steps,
        empty_init=args.empty_init,
        load=args.load,
        save=args.save,
        layers=args.layers,
        llama=args.llama,
        accumulate=args.accumulate,
    )
    write_result(rig, args.out, state, report)


def write_result(rig: torchrig.Rig, out: str, state: dict[str, torch.Tensor], report: dict[str, Any]) -> None:
    """Rank 0 writes the weights to ``out`` and the report to ``out.json``; every rank waits for it."""
    if rig.is_global_zero:
        torch.save(state, out)
        Path(out + ".json").write_text(json.dumps(report))
    rig.barrier()


if __name__ == "__main__":
    main()
