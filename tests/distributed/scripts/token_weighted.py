"""Token-weighted gradient accumulation: padded sequences of unequal lengths, a per-token loss.

    python token_weighted.py --out weights.pt --devices 2 --strategy ddp --accumulate 2 [--clip 0.1] [--loop rig]

``training_step`` returns ``{"loss": loss_sum, "num_items": tokens}``; the Trainer's gradient is
then the one of a single batch holding every micro-batch of the step (of every process):
:func:`reference` computes that directly. Importable for the 1-process runs and the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils.data import DataLoader

import torchrig

FEATURES = 3
LENGTHS = [1, 7, 2, 8, 3, 3, 6, 1]  # 8 sequences; micro-batches of 2 hold 3 to 15 tokens
LR = 0.5


def sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for length in LENGTHS:
        x = torch.randn(length, FEATURES, generator=g)
        out.append((x, x.sum(dim=1).sin() + 0.3 * torch.randn(length, generator=g)))
    return out


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Pad to the longest sequence of the micro-batch; ``mask`` marks the real tokens."""
    longest = max(len(x) for x, _ in items)
    x = torch.zeros(len(items), longest, FEATURES)
    y = torch.zeros(len(items), longest)
    mask = torch.zeros(len(items), longest)
    for i, (xi, yi) in enumerate(items):
        x[i, : len(xi)], y[i, : len(yi)], mask[i, : len(xi)] = xi, yi, 1.0
    return {"x": x, "y": y, "mask": mask, "lengths": [len(xi) for xi, _ in items]}


def loader() -> DataLoader[Any]:
    return DataLoader(sequences(), batch_size=2, collate_fn=collate)  # type: ignore[arg-type]


def init_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Net().state_dict()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def token_errors(net: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (net(x).float() - y) ** 2 * mask


class TokenRegressor(torchrig.TrainingModule):
    """``mode``: ``"tensor"`` (num_items = mask.sum()), ``"int"`` (a Python int), ``"numpy"`` (a
    NumPy integer), ``"mean"`` (the old way: each micro-batch's own mean per token, returned as a
    plain loss)."""

    def __init__(self, mode: str = "tensor") -> None:
        super().__init__()
        self.mode = mode
        self.net = Net()
        self.net.load_state_dict(init_state())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        errors = token_errors(self.net, batch["x"], batch["y"], batch["mask"])
        if self.mode == "mean":
            return errors.sum() / batch["mask"].sum()
        count: Any = batch["mask"].sum() if self.mode == "tensor" else sum(batch["lengths"])
        if self.mode == "numpy":
            count = numpy.int64(count)
        return {"loss": errors.sum(), "num_items": count}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(
    *, mode: str = "tensor", accumulate: int, max_steps: int, clip: float | None = None, **trainer: Any
) -> tuple[dict[str, torch.Tensor], torchrig.Trainer]:
    module = TokenRegressor(mode)
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "max_epochs": -1,
    }
    settings.update(trainer)
    tr = torchrig.Trainer(accumulate_grad_batches=accumulate, max_steps=max_steps, gradient_clip_val=clip, **settings)
    tr.fit(module, loader())
    if tr.world_size == 1:
        return {k: v.detach().clone() for k, v in module.net.state_dict().items()}, tr
    full = tr.rig.strategy.module_state_dict(tr.run.prepared_module)  # FSDP: gathered to rank 0
    return {k.removeprefix("net."): v.detach().clone() for k, v in full.items()}, tr


def rig_fit(
    rig: torchrig.Rig, *, accumulate: int, max_steps: int, clip: float | None = None
) -> dict[str, torch.Tensor]:
    """The same training written with the Rig, as docs/rig.md's recipe does it."""
    net = Net()
    net.load_state_dict(init_state())
    model, optimizer = rig.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    data, steps = rig.prepare(loader()), 0
    while steps < max_steps:
        tokens: Any = 0
        for i, batch in enumerate(data):
            with rig.no_backward_sync(model, enabled=(i + 1) % accumulate != 0):
                errors = token_errors(model, batch["x"], batch["y"], batch["mask"])
                rig.backward(errors.sum())  # the sum, not the mean
            tokens = tokens + batch["mask"].sum()  # a device tensor: no host sync
            if (i + 1) % accumulate == 0:
                total = rig.all_reduce(tokens, op="sum")  # every process's tokens
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                torch._foreach_mul_(grads, rig.world_size / total)  # DDP/FSDP averaged over the processes
                if clip is not None:  # after the scaling
                    rig.clip_gradients(model, optimizer, max_norm=clip)
                optimizer.step()
                optimizer.zero_grad()
                tokens, steps = 0, steps + 1
                if steps == max_steps:
                    break
    full = rig.strategy.module_state_dict(model)
    return {k: v.detach().clone() for k, v in full.items()}


def reference(steps: list[list[int]], clip: float | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain SGD, each step on one batch of the given sequences: sum(loss) / sum(tokens).
    Also the gradient norm of each step (before clipping)."""
    net = Net()
    net.load_state_dict(init_state())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    data, norms = sequences(), []
    for step in steps:
        batch = collate([data[i] for i in step])
        errors = token_errors(net, batch["x"], batch["y"], batch["mask"])
        (errors.sum() / batch["mask"].sum()).backward()
        params = list(net.parameters())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, norms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--mode", default="tensor")
    parser.add_argument("--loop", default="trainer", choices=["trainer", "rig"])
    args = parser.parse_args()
    if args.loop == "rig":
        rig = torchrig.Rig(accelerator="cpu", devices=args.devices, strategy=args.strategy)
        state = rig_fit(rig, accumulate=args.accumulate, max_steps=args.max_steps)
    else:
        strategy: Any = args.strategy
        if strategy.startswith("tp"):  # 2 tensor-parallel processes, 1 data-parallel: both see every batch
            plan = {"net.body.0": "colwise", "net.head": "rowwise"}
            if strategy == "tp_partial":  # the head outside the plan: its gradients are plain tensors
                plan = {"net.body.0": "colwise_rep"}
            strategy = torchrig.ModelParallelStrategy(tensor_parallel=args.devices, tp_plan=plan)
        state, trainer = fit(
            mode=args.mode,
            accumulate=args.accumulate,
            max_steps=args.max_steps,
            clip=args.clip,
            devices=args.devices,
            strategy=strategy,
        )
        rig = trainer.rig
    if rig.is_global_zero:
        torch.save(state, args.out)
        info = {"world_size": rig.world_size, "strategy": type(rig.strategy).__name__}
        Path(args.out + ".json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
