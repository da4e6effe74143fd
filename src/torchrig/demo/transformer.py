"""A decoder-only transformer with a tensor-parallel plan (``_tp_plan``), for N-D parallel examples.

``tiny()`` trains in seconds on a CPU (the distributed tests use it); ``transformer_1b()`` is the
model the planner example sizes (``torchrig plan --devices 64 --tp 8
torchrig.demo.transformer:transformer_1b``). Only torch is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal self-attention. The head count comes from the width of ``q``'s output, so a
    column-split ``q``/``k``/``v`` (tensor parallel) computes its share of the heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``.

    ``_tp_plan`` splits attention and MLP Megatron-style (``q``/``k``/``v``/``up`` by columns,
    ``o``/``down`` by rows: one all-reduce each), the embedding by rows and the output head by
    columns (logits gathered); the norms stay replicated.
    """

    _tp_plan = {
        "tok": "rowwise",
        "layers.*.attn.q": "colwise",
        "layers.*.attn.k": "colwise",
        "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
        "head": "colwise_rep",
    }

    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, hidden: int | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden or 4 * dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny() -> Transformer:
    """About 40 thousand parameters: a vocabulary of 64, width 32, 2 layers of 4 heads."""
    return Transformer(vocab=64, dim=32, layers=2, heads=4)


def transformer_1b() -> Transformer:
    """About 1.04 billion parameters: width 2048, 18 layers of 16 heads, vocabulary 32,000."""
    return Transformer(vocab=32000, dim=2048, layers=18, heads=16)


def tokens_1b() -> torch.Tensor:
    """An input for ``transformer_1b``: 2 sequences of 16 token ids (``torchrig plan --input``)."""
    return torch.randint(0, 32000, (2, 16))
