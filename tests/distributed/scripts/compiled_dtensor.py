"""Compiled prepared modules and DTensor values in the Rig's API, on 2 gloo processes.

    python compiled_dtensor.py --out R.json --part sync     # DDP: no_backward_sync(torch.compile(prepared))
    python compiled_dtensor.py --out R.json --part gather   # FSDP: all_gather / all_reduce of DTensor values

Rank 0 writes what it saw to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchrig


def sync(rig: torchrig.Rig) -> dict[str, Any]:
    """Each rank backpropagates its own input: inside no_backward_sync of the compiled module the
    gradients stay each rank's own; outside it, DDP averages them."""
    torch.manual_seed(0)
    model = rig.prepare(nn.Linear(3, 1, bias=False))
    compiled = torch.compile(model, backend="eager")  # an OptimizedModule around the prepared module
    x = torch.full((1, 3), float(rig.global_rank + 1))
    with rig.no_backward_sync(compiled):
        compiled(x).sum().backward()
    own = rig.all_gather(model.weight.grad.clone())
    model.weight.grad = None
    compiled(x).sum().backward()
    synced = rig.all_gather(model.weight.grad.clone())
    return {"own": own.tolist(), "synced": synced.tolist()}


def gather(rig: torchrig.Rig) -> dict[str, Any]:
    """Values computed from FSDP2's DTensor parameters, gathered and reduced as plain tensors."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    full = net.weight.detach().clone()
    model = rig.prepare(net)
    weight = model.weight  # a DTensor: this rank holds one row
    doubled = weight.detach() * 2  # a DTensor too
    gathered = rig.all_gather({"w": doubled})["w"]
    reduced = rig.all_reduce(doubled, op="sum")
    return {
        "is_dtensor": type(doubled).__name__,
        "gathered": gathered.tolist(),
        "reduced": reduced.tolist(),
        "full": full.tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", choices=["sync", "gather"], required=True)
    args = parser.parse_args()
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp" if args.part == "sync" else "fsdp")
    report = sync(rig) if args.part == "sync" else gather(rig)
    if rig.is_global_zero:
        Path(args.out).write_text(json.dumps(report))
    rig.barrier()


if __name__ == "__main__":
    main()
