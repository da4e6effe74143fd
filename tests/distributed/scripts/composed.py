"""DDP carried by the accelerator, as the Accelerator documents compose it, on 2 processes.

    python composed.py --out weights.pt --form rig|trainer

``rig``: ``train.py``'s run on ``Rig(accelerator=CPUAccelerator(precision_plugin=Precision(...),
training_type_plugin=DDPStrategy()), devices=2)``; rank 0 writes the weights and ``OUT.json``.
``trainer``: the documents' example, ``Trainer(accelerator=CPUAccelerator(precision_plugin="bf16-mixed",
training_type_plugin=DDPStrategy()), devices=2)``, fits a small module; each rank writes
``OUT.rankN.pt`` (its weights) and ``OUT.rankN.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from train import train

import torchrig


def run_rig(out: str) -> None:
    accelerator = torchrig.CPUAccelerator(
        precision_plugin=torchrig.Precision(name="32-true", device_type="cpu"),
        training_type_plugin=torchrig.DDPStrategy(),
    )
    rig = torchrig.Rig(accelerator=accelerator, devices=2)
    state, _ = train(rig)
    if rig.is_global_zero:
        torch.save(state, out)
        info = {
            "world_size": rig.world_size,
            "strategy": type(rig.strategy).__name__,
            "precision": rig.precision.name,
            "carried_objects_used": rig.strategy is accelerator.strategy and rig.precision is accelerator.precision,
        }
        Path(out + ".json").write_text(json.dumps(info))
    rig.barrier()


class Net(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.dtypes: set[str] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layer(x)
        self.dtypes.add(str(out.dtype))
        return torch.nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_trainer(out: str) -> None:
    accelerator = torchrig.CPUAccelerator(precision_plugin="bf16-mixed", training_type_plugin=torchrig.DDPStrategy())
    trainer = torchrig.Trainer(
        accelerator=accelerator,
        devices=2,
        max_steps=3,
        default_root_dir=Path(out).parent,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    torch.manual_seed(6 + trainer.rig.global_rank)  # different initial weights per rank: DDP must sync them
    model = Net()
    trainer.fit(model, train_dataloaders=data)
    rank = trainer.rig.global_rank
    torch.save(model.state_dict(), f"{out}.rank{rank}.pt")
    info = {
        "world_size": trainer.rig.world_size,
        "strategy": type(trainer.rig.strategy).__name__,
        "precision": trainer.rig.precision.name,
        "carried_strategy_used": trainer.rig.strategy is accelerator.strategy,
        "dtypes": sorted(model.dtypes),
        "global_step": trainer.global_step,
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(info))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--form", choices=("rig", "trainer"), required=True)
    args = parser.parse_args()
    (run_rig if args.form == "rig" else run_trainer)(args.out)


if __name__ == "__main__":
    main()
