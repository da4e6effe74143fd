"""Where does fp8-mixed's loss gap come from? A CPU study with torchao's float8 *emulated*.

    python benchmarks/fp8_cpu_study.py                                  # width 256, 4 blocks, 200 steps, 2 seeds
    python benchmarks/fp8_cpu_study.py --dim 512 --layers 2 --variants bf16,tensorwise
    python benchmarks/fp8_cpu_study.py --steps 400 --warmup-steps 50

``benchmarks/gpu_fp8.py``'s model family (``gpu_transformer.Transformer``), data (tokens that
follow a permutation but for ``NOISE``) and optimizer (AdamW, lr 3e-4, weight decay 0.1, constant
lr unless ``--warmup-steps``) at a size a CPU trains in minutes, through ``Rig`` on the CPU:
``bf16-mixed`` against ``fp8-mixed`` variants whose ``Float8LinearConfig`` has ``emulate=True``
(torchao casts to float8 and back with the same dynamic scales, and multiplies in high precision:
the rounding of float8 without a float8 matmul). What it cannot show: the GPU's float8 matmul
itself (its ``use_fast_accum`` accumulation in the forward) and anything about speed.

Each variant trains from the same initial weights on the same batches as ``bf16`` (per seed: the
seed sets both). Printed per variant: the loss (mean of the last 10 steps, as ``gpu_fp8.py``; and of
the last 50) against ``bf16``'s, and the *delay*: how many steps later than ``bf16`` the variant
reaches the loss that ``bf16`` had 10 steps before the end (both curves smoothed over 10 steps);
a delay of a few steps while the loss still falls steeply reads as a large gap at a fixed step.
``32-true`` is the yardstick of what a change of rounding alone does to the trajectory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table
from gpu_fp8 import delay, precisions, structured_tokens
from gpu_transformer import Config, Transformer, loss_of

import torchrig


def _filters() -> dict[str, Callable[[nn.Module, str], bool] | None]:
    return {
        "default": None,  # torchrig's default: every nn.Linear but the first (blocks.0.qkv) and the last (head)
        "blocks": lambda m, fqn: fqn.startswith("blocks."),  # every block's linear layers, head in bf16
        "mlp": lambda m, fqn: fqn.startswith("blocks.") and fqn.rsplit(".", 1)[-1] in ("gate", "up", "down"),
        "attn": lambda m, fqn: fqn.startswith("blocks.") and fqn.rsplit(".", 1)[-1] in ("qkv", "out"),
    }


def variants() -> dict[str, Any]:
    """A name -> the ``precision=`` argument. fp8 names: ``<recipe>[:<layers>]``, the recipes those
    of ``gpu_fp8.precisions`` (emulated)."""
    out: dict[str, Any] = {"bf16": "bf16-mixed", "32-true": "32-true"}
    for recipe, (_, precision) in precisions(emulate=True).items():
        if recipe in ("bf16", "tensorwise-exact"):  # emulated, the matmul's accumulation is exact anyway
            continue
        for layers, fn in _filters().items():
            name = recipe if layers == "default" else f"{recipe}:{layers}"
            out[name] = dataclasses.replace(precision, module_filter_fn=fn)
    return out


def train(precision: Any, cfg: Config, batches: torch.Tensor, seed: int, lr: float, warmup_steps: int) -> list[float]:
    rig = torchrig.Rig(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(seed)
    model = rig.prepare(Transformer(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    optimizer = rig.prepare(optimizer)
    losses = []
    for tokens in batches:
        with rig.autocast():
            loss = loss_of(model(tokens[:, :-1]), tokens[:, 1:])
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.detach())
    return torch.stack(losses).float().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="default: dim x 2.75 rounded to 16 (5632/2048)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear lr warm-up (gpu_fp8.py: none)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--variants", default="bf16,32-true,tensorwise,rowwise,tensorwise:blocks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--curves", default=None, help="write every loss curve to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden = args.hidden or round(args.dim * 2.75 / 16) * 16
    cfg = Config(hidden=hidden, **{f: getattr(args, f) for f in ("vocab", "dim", "layers", "heads", "seq", "batch")})
    known = variants()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in known]
    if unknown or names[0] != "bf16":
        parser.error(f"--variants must start with bf16 and name only {', '.join(known)}; got {args.variants!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    curves: dict[str, list[list[float]]] = {n: [] for n in names}
    start = time.perf_counter()
    for seed in seeds:
        batches = structured_tokens(cfg, args.steps * cfg.batch, seed=seed).view(args.steps, cfg.batch, cfg.seq + 1)
        for name in names:
            curves[name].append(train(known[name], cfg, batches, seed, args.lr, args.warmup_steps))
            c = curves[name][-1]
            print(
                f"seed {seed} {name}: loss {c[0]:.3f} -> {statistics.fmean(c[-10:]):.4f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    if args.curves:
        with open(args.curves, "w") as f:
            json.dump({"args": vars(args), "curves": curves}, f)
    body = []
    for name in names:
        last10, last50, delays = [], [], []
        for base, c in zip(curves["bf16"], curves[name], strict=True):
            last10.append(statistics.fmean(c[-10:]) / statistics.fmean(base[-10:]) - 1)
            last50.append(statistics.fmean(c[-50:]) / statistics.fmean(base[-50:]) - 1)
            delays.append(delay(base, c))
        body.append(
            [
                name,
                " ".join(f"{statistics.fmean(c[-10:]):.4f}" for c in curves[name]),
                " ".join(f"{x:+.2%}" for x in last10),
                " ".join(f"{x:+.2%}" for x in last50),
                " ".join(f"{x:+.1f}" for x in delays),
            ]
        )
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(cfg).parameters())
    print_table(
        f"CPU, float8 EMULATED (torchao emulate=True): {cfg.layers} blocks x width {cfg.dim} (hidden {hidden}, "
        f"{cfg.heads} heads), vocab {cfg.vocab}, {params / 1e6:.1f}M parameters, {cfg.batch} x {cfg.seq} tokens a "
        f"step, {args.steps} AdamW steps, lr {args.lr}, warm-up {args.warmup_steps}; per seed {args.seeds}",
        ["variant", "loss, last 10", "vs bf16, last 10", "vs bf16, last 50", "delay (steps)"],
        body,
        markdown=args.markdown,
    )
    print(f"command: python benchmarks/fp8_cpu_study.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
