"""The same training, model built in the calling process, on every process layout; prints the
final weights as JSON lines ``{"layout": ..., "weights": [...]}``.

    python layouts.py launched RUNS   # 1 process, ddp_notebook, Rig.launch (spawn), then
                                      # ddp_spawn RUNS times
    python layouts.py ddp             # Trainer.fit with strategy="ddp" (this process starts rank 1)
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchrig

PER_PROCESS_BATCH = 4
SAMPLES = 32  # 4 steps an epoch with the global batch of 8


def data(batch_size: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=batch_size)


class Net(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def flat(module: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def fit(strategy: str, devices: int) -> Net:
    module = Net()  # built here, in the calling process
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(module, data(PER_PROCESS_BATCH * 2 // devices))
    return module


def loop(rig: torchrig.Rig, module: Net) -> dict[str, Any]:
    """Rig.launch's function: the Trainer's computation written by hand."""
    shared = any(p.is_shared() for p in module.parameters())
    model, optimizer, loader = rig.prepare(module, module.configure_optimizers(), data(PER_PROCESS_BATCH))
    for _ in range(2):
        for x, y in loader:
            rig.backward(torch.nn.functional.mse_loss(model(x), y))  # through DDP: gradients averaged
            optimizer.step()
            optimizer.zero_grad()
    weights = rig.all_gather(torch.tensor(flat(module)))
    return {"weights": weights[0].tolist(), "ranks_agree": bool(torch.equal(weights[0], weights[1])), "shared": shared}


def emit(layout: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"layout": layout, **fields}) + "\n")  # one write: ranks share the output


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        module = fit("ddp", 2)
        if int(__import__("os").environ.get("RANK", "0")) == 0:
            emit("ddp", weights=flat(module))
    else:
        emit("initial", weights=flat(Net()))
        emit("one process", weights=flat(fit("single", 1)))
        emit("ddp_notebook", weights=flat(fit("ddp_notebook", 2)))
        module = Net()  # created before launch, sent to the workers
        emit("Rig.launch", **torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(loop, module))
        for _ in range(int(sys.argv[2])):
            emit("ddp_spawn", weights=flat(fit("ddp_spawn", 2)))
