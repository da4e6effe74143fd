"""The Trainer with pipeline parallel: a TrainingModule around the demo transformer (4 blocks) fitted,
validated, tested and predicted, its checkpoints saved every 2 steps.

    python pipeline_fit.py ROOT OUT [--devices 2 --pp 2 --schedule 1F1B] [--steps 4] [--accumulate 1]
        [--resume CKPT] [--manual] [--items]

With more devices than stages the rest shard each stage with FSDP2 (``--devices 4 --pp 2``:
pp=2 x dp_shard=2), each data-parallel rank reading its part of the same global batches.

Rank 0 writes OUT (``torch.save``): the final full weights, the rows the CSV logger wrote, the
results of ``validate`` and ``test``, the predictions and the ThroughputMonitor's last values.
Every rank writes what its ``callback_metrics`` held after the fit to ``OUT.rank<R>``. Importable
for the one-process reference (``run``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.demo.transformer import Transformer
from torchrig.trainer.loggers import read_metrics

BATCH = 8
SEQ = 8


def data(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (samples, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class LM(torchrig.TrainingModule):
    def __init__(self, manual: bool = False, items: bool = False) -> None:
        super().__init__()
        self.automatic_optimization, self.items = not manual, items
        torch.manual_seed(0)
        self.net = Transformer(vocab=64, dim=32, layers=4, heads=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the schedule runs it on each stage
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.forward_loss(next_token_loss, x, target=y)
        self.log("train_loss", loss, sync_dist=True)  # the mean over data-parallel ranks (pp x dp_shard)
        return {"loss": loss * y.numel(), "num_items": y.numel()} if self.items else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.forward_loss(next_token_loss, x, target=y), batch_size=len(x), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)  # the whole model's output, on every rank
        self.log("test_acc", (logits.argmax(-1) == y).float().mean(), batch_size=len(x), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run(
    root: str,
    *,
    devices: int = 1,
    pp: int = 1,
    schedule: str = "1F1B",
    steps: int = 4,
    accumulate: int = 1,
    resume: str | None = None,
    manual: bool = False,
    items: bool = False,
) -> tuple[dict[str, Any], torchrig.Trainer]:
    strategy: Any = torchrig.ModelParallelStrategy(pipeline_parallel=pp, pp_schedule=schedule) if pp > 1 else "single"
    logger = torchrig.CSVLogger(root_dir=root, version=0, flush_every_n_steps=1)
    monitor = torchrig.ThroughputMonitor(flops_per_batch=1e9, peak_flops=1e12)
    saver = torchrig.ModelCheckpoint(dirpath=Path(root) / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5,
        seed=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=logger,
        callbacks=[monitor, saver],
        log_every_n_steps=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    module = LM(manual, items)
    per_rank = BATCH // trainer.rig.strategy.data_parallel_size  # the same global batches on every layout
    train = DataLoader(data(4 * BATCH, 123), batch_size=per_rank)
    held_out = DataLoader(data(BATCH + 2, 7), batch_size=per_rank)  # batches of 8 and 2 samples (in one process)
    trainer.fit(module, train, held_out, ckpt_path=resume)
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
    weights = trainer.rig.strategy.module_state_dict(module)
    validated = trainer.validate(module, held_out)
    tested = trainer.test(module, held_out)
    predicted = trainer.predict(module, held_out)
    logger.finalize("success")
    result = {
        "weights": weights,
        "fitted": fitted,
        "rows": read_metrics(logger.log_dir) if trainer.is_global_zero else [],
        "validate": validated,
        "test": tested,
        "predict": predicted,
        "throughput": dict(monitor.last_values),
        "checkpoints": sorted(p.name for p in (Path(root) / "ckpt").iterdir()) if trainer.is_global_zero else [],
    }
    return result, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--manual", action="store_true", help="automatic_optimization = False (refused)")
    parser.add_argument("--items", action="store_true", help="token-weighted steps (refused)")
    args = vars(parser.parse_args())
    out = args.pop("out")
    result, trainer = run(**args)  # the options are run's keywords
    torch.save(result["fitted"], f"{out}.rank{trainer.global_rank}")
    if trainer.is_global_zero:
        torch.save(result, out)


if __name__ == "__main__":
    main()
