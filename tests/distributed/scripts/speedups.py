"""A tiny transformer trained a few steps with ``compile=`` / ``activation_checkpointing=``
(used by tests/unit/test_speedups.py in one process and tests/distributed/test_dist_speedups.py
on 2 processes).

    python speedups.py --out w.pt --strategy ddp|fsdp [--compile regional] [--ac full]

Writes the final full state dict (rank 0) and, in ``--out``.json, the dynamo graph count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchrig

VOCAB, DIM, SEQ, BATCH, STEPS = 32, 16, 8, 8, 3  # BATCH: the global batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(n: int = STEPS, batch: int = BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(n)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(rig: torchrig.Rig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD steps on the same global batches (each rank takes its slice); the losses (this rank's)
    and the full final state dict (on rank 0 under FSDP)."""
    torch.manual_seed(0)
    model = rig.prepare(TinyTransformer())
    optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for tokens in batches():
        mine = tokens.chunk(rig.world_size)[rig.global_rank].to(rig.device)
        loss = loss_of(model, mine)
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return [float(x) for x in losses], rig.strategy.module_state_dict(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--compile", default=None)
    parser.add_argument("--ac", default=None)
    args = parser.parse_args()
    rig = torchrig.Rig(
        accelerator="cpu", devices=2, strategy=args.strategy, compile=args.compile, activation_checkpointing=args.ac
    )
    _, state = train(rig)
    info: dict[str, Any] = {"graphs": 0}
    if args.compile:
        from torch._dynamo.utils import counters

        info["graphs"] = counters["stats"]["unique_graphs"]
    if rig.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in state.items()}, args.out)
        Path(args.out + ".json").write_text(json.dumps(info))
    rig.barrier()


if __name__ == "__main__":
    main()
