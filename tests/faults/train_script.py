"""A small training run for the fault-injection test: it is killed at random points and resumed.

It prints ``step N`` after every optimizer step and ``saved N`` after every checkpoint, so the
test can SIGKILL it at a chosen moment. ``--pause-in-save S`` makes every file write inside a
save (and the final rename) print ``in-save`` and sleep ``S`` seconds, so a kill lands mid-save.
At the end it writes the final weights to ``--out`` (safetensors).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.checkpoint import files


def pause_saves(seconds: float, emit: Callable[[str], None]) -> None:
    durable, commit = files.durable, files.commit

    def slow_durable(path: Path) -> None:  # called once each file is written, to fsync it
        durable(path)
        emit(f"in-save write {path.name}")
        time.sleep(seconds)

    def slow_commit(tmp: Path, target: Path) -> None:
        emit(f"in-save commit {target.name}")
        time.sleep(seconds)
        commit(tmp, target)

    files.durable = slow_durable
    files.commit = slow_commit


def main(argv: list[str], emit: Callable[[str], None] = print) -> None:
    """Train (resuming from ``--ckpt``/last when it exists); ``emit`` reports progress lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--pause-in-save", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.pause_in_save:
        pause_saves(args.pause_in_save, emit)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torchrig.seed_everything(1234)
    rig = torchrig.Rig(accelerator="cpu")
    data = TensorDataset(torch.randn(44, 8), torch.randn(44, 1))  # 44 / 8: the last batch is short
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = rig.prepare(model, optimizer, loader)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader, "step": 0}

    last = Path(args.ckpt) / "last"
    if last.exists():
        rig.load(last, state)
        emit(f"resumed {state['step']}")
    step = state["step"]
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            emit(f"step {step}")
            if step % args.save_every == 0:
                state["step"] = step
                rig.save(Path(args.ckpt) / f"step-{step:05d}", state, keep_last=2)
                emit(f"saved {step}")
            if step >= args.steps:
                break
    safetensors.torch.save_file(model.state_dict(), args.out)
    emit("done")


if __name__ == "__main__":
    main(sys.argv[1:], lambda line: print(line, flush=True))
