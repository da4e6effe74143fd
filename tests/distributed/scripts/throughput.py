"""ThroughputMonitor under data parallelism: every rank writes what the monitor logged.

    python throughput.py --out values --devices 2 --strategy ddp [--count]

Each training batch advances a fake clock one second (so each logging window's length is known),
rank ``r`` returns ``num_items = (r + 1) * (batch_idx + 1)``; batches of 4 samples, logging every
2 steps, 5 batches per rank. Rank ``r`` writes ``<out>.rank<r>.json``: ``{"rows": {step: values},
"flops": the monitor's FLOPs per batch}`` (given, 1e6, or with ``--count`` counted on the first batch).
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.trainer import throughput
from torchrig.trainer.logger_base import Logger

CLOCK = {"now": 0.0}
throughput.time = types.SimpleNamespace(perf_counter=lambda: CLOCK["now"])  # type: ignore[attr-defined]


class Rows(Logger):
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass


class Module(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK["now"] += 1.0
        x, y = batch
        loss_sum = torch.nn.functional.mse_loss(self.net(x), y, reduction="sum")
        return {"loss": loss_sum, "num_items": torch.tensor((self.trainer.global_rank + 1) * (batch_idx + 1))}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--count", action="store_true", help="count the FLOPs (else given: 1e6)")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 3, generator=g), torch.randn(40, 1, generator=g))
    rows = Rows()
    monitor = throughput.ThroughputMonitor(flops_per_batch=None if args.count else 1e6, peak_flops=1e12)
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=1,
        logger=rows,
        callbacks=[monitor],
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=4))
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(
        json.dumps({"rows": rows.rows, "flops": monitor.flops})
    )


if __name__ == "__main__":
    main()
