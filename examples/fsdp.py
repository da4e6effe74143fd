"""Sharded training with FSDP2 (``fully_shard``): a small transformer, created on ``meta``.

    python examples/fsdp.py                         # 2 CPU processes (gloo)
    torchrig run --devices 2 --strategy fsdp examples/fsdp.py
    torchrig run --accelerator cuda --devices 8 --precision bf16-mixed --strategy fsdp examples/fsdp.py

Each ``Block`` is sharded on its own (its parameters are gathered only for its forward and
backward), the model is created with ``empty_init=True`` so no process ever holds the full
weights, and the optimizer is created before ``prepare`` (prepare switches it to the shards).
The checkpoint goes to a temporary directory, removed at the end, unless ``--out DIR`` is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
import torchrig.checkpoint
from torchrig.strategies import FSDPStrategy


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, num_heads=4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every position, ``(batch * length, vocab)``.

        The head runs on the flattened positions: a linear layer on a 3-d input returns a view of
        its 2-d product, and FSDP2 warns about a sharded module's output that is a view (an
        in-place op on it would skip the hook that gathers the parameters for backward).
        """
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(0, 1))


def make_data(n: int = 512, length: int = 16, vocab: int = 64) -> TensorDataset:
    """Sequences that count up modulo ``vocab``: the next token is easy to learn."""
    start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
    seq = (start + torch.arange(length + 1)) % vocab
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default=None)
    parser.add_argument("--devices", default=None)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--out", default=None, help="keep the sharded checkpoint and model.safetensors here (default: a temp folder)"
    )
    args = parser.parse_args()
    launched = "WORLD_SIZE" in os.environ
    rig = torchrig.Rig(
        accelerator=args.accelerator or (None if launched else "cpu"),
        devices=args.devices or (None if launched else 2),
        strategy=FSDPStrategy(auto_wrap_policy={Block}),
        precision=args.precision,
    )
    rig.seed_everything(0)
    # Rank zero picks the folder; every rank writes its shards into the same one.
    out = args.out or rig.broadcast(tempfile.mkdtemp(prefix="torchrig-fsdp-") if rig.is_global_zero else None)
    with rig.init_module(empty_init=True):  # parameters on meta: no memory, no init time
        model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # prepare shards the model, materialises each rank's shards, and re-points the optimizer.
    model, optimizer = rig.prepare(model, optimizer)
    loader = rig.prepare(DataLoader(make_data(), batch_size=16, shuffle=True))

    for epoch in range(args.epochs):
        total = torch.zeros((), device=rig.device)
        for tokens, targets in loader:
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits, targets.flatten())
            rig.backward(loss)
            rig.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        rig.print(f"epoch {epoch}: loss {rig.all_reduce(total / len(loader)).item():.4f}")

    # A sharded checkpoint: every rank writes its own shards in parallel (torch.distributed.checkpoint).
    path = rig.save(os.path.join(out, "fsdp-last"), {"model": model, "optimizer": optimizer, "epoch": epoch})
    if rig.is_global_zero:
        # One plain safetensors file that loads anywhere, without torchrig or several processes.
        single = torchrig.checkpoint.consolidate(path, os.path.join(out, "model.safetensors"))
        weights = load_file(str(single))
        reference = TinyLM()
        reference.load_state_dict(weights)  # every key and shape of the full model is there
        count = sum(t.numel() for t in weights.values())
        rig.print(f"sharded checkpoint {path.name} consolidated: {len(weights)} tensors, {count} parameters")
    rig.barrier("consolidated")
    if args.out is None and rig.is_global_zero:
        shutil.rmtree(out)
        rig.print(f"removed {out} (pass --out DIR to keep the checkpoint)")
    elif rig.is_global_zero:
        rig.print(f"wrote {path} and {single}")


if __name__ == "__main__":
    main()
