"""A hand-written Rig loop for the ``torchrig run --max-restarts`` tests.

    torchrig run --devices 2 --max-restarts 1 restart_fit.py --ckpt DIR --out w.pt [--kill-at 13] [--fail-at 2]

It saves ``DIR/step-N`` (and the ``last`` link) every ``--save-every`` steps and resumes from
``DIR/last`` when it exists. ``--kill-at N``: rank 1 SIGKILLs itself at step N of the first
attempt (``TORCHELASTIC_RESTART_COUNT == 0``). ``--fail-at N``: rank 1 raises at step N of every
attempt (a crash loop), or with ``--fail-attempt A`` only in attempt A. Prints
``attempt A starts at step S`` once per attempt (rank 0).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--fail-at", type=int, default=0)
    parser.add_argument("--fail-attempt", type=int, default=-1)  # -1: every attempt
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    torchrig.seed_everything(1234)
    rig = torchrig.Rig(accelerator="cpu", strategy="ddp")
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(80, 6, generator=g), torch.randn(80, 1, generator=g))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=8 // rig.world_size, shuffle=True)
    model, optimizer, loader = rig.prepare(model, optimizer, loader)
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    last = Path(args.ckpt) / "last"
    if last.exists():
        rig.load(last, state)
    step = state["step"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rig.print(f"attempt {attempt} starts at step {step}", flush=True)
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if rig.global_rank == 1 and step == args.kill_at and attempt == 0:
                print(f"rank 1 SIGKILLs itself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if rig.global_rank == 1 and step == args.fail_at and args.fail_attempt in (-1, attempt):
                raise RuntimeError(f"boom on purpose at step {step}")
            if step % args.save_every == 0:
                state["step"] = step
                rig.save(Path(args.ckpt) / f"step-{step:04d}", state)
            if step == args.steps:
                break
    if rig.is_global_zero:
        torch.save({k: v.clone() for k, v in rig.strategy.module_state_dict(model).items()}, args.out)


if __name__ == "__main__":
    main()
