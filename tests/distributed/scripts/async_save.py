"""Background saves across 2 processes (gloo, CPU): ``python async_save.py ddp|fsdp DIR OUT``.
Each rank writes what it found to ``OUT/rank<N>.json``.

ddp:  a background save while training goes on loads as the state of the call on every rank;
      rank 0's disk then fills during a background save: every rank raises at the next save,
      rank 0 the CheckpointError, rank 1 what rank 0 reported.
fsdp: a sharded background save (DCP async_save, thread mode) while training goes on loads as
      the state of the call; the ranks keep training (collectives on the default group) while
      DCP runs its own on the background save's group.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchrig
from torchrig.checkpoint import tensors


def _model(rig: torchrig.Rig, strategy: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = rig.prepare(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)))
    return model, rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))


def _step(rig: torchrig.Rig, model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + rig.global_rank)
    rig.backward(model(torch.randn(4, 6, generator=g)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def _full(rig: torchrig.Rig, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in rig.strategy.module_state_dict(model).items()}


def ddp(rig: torchrig.Rig, folder: Path) -> dict[str, Any]:
    model, optimizer = _model(rig, "ddp")
    _step(rig, model, optimizer, 1)
    before = _full(rig, model)
    handle = rig.save(folder / "a", {"model": model, "optimizer": optimizer, "step": 1}, blocking=False)
    for seed in (2, 3):  # training goes on (DDP's all-reduces) while rank 0 writes
        _step(rig, model, optimizer, seed)
    assert handle.wait() == folder / "a" and handle.done()
    fresh, fresh_opt = _model(rig, "ddp")
    left = rig.load(folder / "last", {"model": fresh, "optimizer": fresh_opt})
    same = all(torch.equal(v, before[k]) for k, v in _full(rig, fresh).items())
    reached = threading.Event()
    if rig.is_global_zero:  # a full disk on rank 0 only, during the next background save
        real = tensors.write_safetensors

        def no_space(path: Path, *args: Any, **kwargs: Any) -> str:
            reached.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        tensors.write_safetensors = no_space
    rig.save(folder / "b", {"model": model, "step": 3}, blocking=False)
    _step(rig, model, optimizer, 4)
    if rig.is_global_zero:
        # the disk is "freed" only once the background writer met it full (on a loaded machine
        # the writer thread may not have reached the tensors yet when the step is over)
        assert reached.wait(60), "the background save never wrote its tensors"
        tensors.write_safetensors = real
    try:
        rig.save(folder / "c", {"model": model, "step": 4})
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    rig.barrier()
    return {"step": left["step"], "same": same, "error": error, "dirs": sorted(os.listdir(folder))}


def fsdp(rig: torchrig.Rig, folder: Path) -> dict[str, Any]:
    model, optimizer = _model(rig, "fsdp")
    _step(rig, model, optimizer, 1)
    before = _full(rig, model)
    handle = rig.save(folder / "s", {"model": model, "optimizer": optimizer, "step": 1}, blocking=False)
    for seed in (2, 3):
        _step(rig, model, optimizer, seed)
    after = _full(rig, model)
    handle.wait()
    fresh, fresh_opt = _model(rig, "fsdp")
    left = rig.load(folder / "last", {"model": fresh, "optimizer": fresh_opt})
    loaded = _full(rig, fresh)
    # A second background save: the save group is made once and reused.
    rig.save(folder / "t", {"model": model, "optimizer": optimizer, "step": 3}, blocking=False).wait()
    again = _full(rig, fresh)
    rig.load(folder / "t", {"model": fresh, "optimizer": fresh_opt})
    return {
        "step": left["step"],
        "same": all(torch.equal(v, before[k]) for k, v in loaded.items()),
        "moved": any(not torch.equal(v, before[k]) for k, v in after.items()),
        "second": all(torch.equal(v, after[k]) for k, v in _full(rig, fresh).items())
        and not all(torch.equal(v, after[k]) for k, v in again.items()),
        "sharded": torchrig.checkpoint.describe(folder / "s")["sharded"],
    }


if __name__ == "__main__":
    mode, folder, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=mode)
    result = {"ddp": ddp, "fsdp": fsdp}[mode](rig, folder)
    (out / f"rank{rig.global_rank}.json").write_text(json.dumps(result))
