"""Buffers that differ from rank to rank, saved per rank and given back to each rank.

A module's state is saved once: rank zero's copy (whole checkpoints), or the one copy DCP keeps
of a tensor every rank holds whole (sharded checkpoints). Parameters are the same on every rank,
but a buffer need not be: under FSDP each process updates BatchNorm's running statistics from its
own batches (FSDP2, unlike DDP, does not broadcast buffers), so one copy would give every rank the
statistics of one of them, and a resumed run would validate (and go on) differently. So at every
save the ranks compare a digest of each persistent buffer that is not sharded (a plain tensor, not
a DTensor); the buffers whose digests differ are gathered and saved as every rank's own copy
(``state.pt``'s ``rank_buffers``, beside the RNG states), and a load gives each rank its own copy
back. A load with another number of processes gives every rank rank zero's copy, with a warning.
Checkpoints without ``rank_buffers`` (saved by an earlier torchrig, or where every rank agreed)
load as before.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch import nn

from torchrig.dtensors import is_dtensor

#: Per module entry: every rank's copy of the buffers that differed, ``[{name: tensor}, ...]`` by rank.
RankBuffers = dict[str, list[dict[str, torch.Tensor]]]


def plain_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``module`` that every rank holds whole (not DTensors), by name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set or is_dtensor(buf):
                continue
            out.setdefault(f"{prefix}.{name}" if prefix else name, buf)
    return out


def _digest(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).contiguous().cpu()
    return f"{data.dtype}:{hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()}"


def every_rank_buffers(rig: Any, modules: dict[str, nn.Module]) -> RankBuffers:
    """Every rank's copy of the buffers of ``modules`` that are not the same on every rank (two
    collectives on every rank, the second only when some differ); ``{}`` in one process."""
    if not (rig.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    buffers = {key: plain_buffers(m) for key, m in modules.items()}
    digests = {key: {n: _digest(b) for n, b in bufs.items()} for key, bufs in buffers.items()}
    ranks: list[Any] = [None] * rig.world_size
    torch.distributed.all_gather_object(ranks, digests)
    differ = {key: names for key in modules if (names := _differing(key, ranks))}
    if not differ:
        return {}
    own = {
        key: {n: buffers[key][n].detach().cpu() for n in names if n in buffers[key]} for key, names in differ.items()
    }
    copies: list[Any] = [None] * rig.world_size
    torch.distributed.all_gather_object(copies, own)
    return {key: [rank[key] for rank in copies] for key in differ}


def _differing(key: str, ranks: list[dict[str, dict[str, str]]]) -> list[str]:
    """The buffers of entry ``key`` that ranks hold with different digests (a buffer only one rank
    holds, a pipeline stage's, has one digest: that rank saves it whole, it is not per rank)."""
    seen: dict[str, set[str]] = {}
    for rank in ranks:
        for name, digest in rank.get(key, {}).items():
            seen.setdefault(name, set()).add(digest)
    return sorted(n for n, digests in seen.items() if len(digests) > 1)


def restore_rank_buffers(rig: Any, saved: RankBuffers | None, modules: dict[str, nn.Module]) -> None:
    """Copy this rank's saved buffers (see the module's notes) into the loaded ``modules``; with
    another number of processes than the save had, rank zero's copy, with a warning."""
    for key, module in modules.items():
        per_rank = (saved or {}).get(key)
        if not per_rank:
            continue
        if len(per_rank) == rig.world_size:
            mine = per_rank[rig.global_rank]
        else:
            mine = per_rank[0]
            if rig.is_global_zero:
                warnings.warn(
                    f"checkpoint entry {key!r} was saved by {len(per_rank)} processes whose buffers "
                    f"{sorted(mine)} differed (each process's own BatchNorm statistics, say); this run has "
                    f"{rig.world_size} process(es), so every process takes rank 0's copy: resume with "
                    f"{len(per_rank)} processes to give each its own",
                    stacklevel=2,
                )
        own = plain_buffers(module)
        with torch.no_grad():
            for name, value in mine.items():
                if name in own and own[name].shape == value.shape:
                    own[name].copy_(value)
