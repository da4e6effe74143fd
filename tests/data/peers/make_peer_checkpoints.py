"""Regenerate the peer checkpoints that ``tests/unit/test_checkpoint_import.py`` imports.

Lightning and Accelerate are not dependencies of torchrig: run this with a throwaway environment
that has them, and torch pinned as torchrig pins it::

    python -m venv /tmp/peers && /tmp/peers/bin/pip install -c constraints.txt lightning accelerate
    /tmp/peers/bin/python tests/data/peers/make_peer_checkpoints.py

It writes, next to itself:

- ``lightning.ckpt``: what Lightning's ``ModelCheckpoint`` saved at the end of the 2nd epoch of a
  LightningModule holding ``self.model = nn.Linear(4, 2)``, trained with Adam and a StepLR
  (2 batches an epoch, so 4 optimizer steps).
- ``lightning_mid.ckpt``: what a second ``ModelCheckpoint(every_n_train_steps=3)`` of the same run
  saved after the 3rd step, inside the 2nd epoch.
- ``accelerate/``: what ``Accelerator.save_state`` wrote after 3 steps of an ``nn.Linear(4, 2)``
  with Adam, a StepLR and a prepared DataLoader.
- ``lightning_expected.safetensors`` and ``accelerate_expected.safetensors``: the tensors each
  peer held when it saved (module weights ``module/NAME``, optimizer state
  ``optimizer/PARAM/NAME``, the torch CPU RNG state ``rng/torch``), taken from the live objects
  and not from the files, with the step, the epoch, the learning rate and each library's version
  in the metadata. The test compares what ``rig.load`` restores from the imported checkpoint with
  these, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 2, generator=g))


def expected(module: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> tuple[dict, dict]:
    """The live tensors of ``module`` and ``optimizer``, named for the expected-values file."""
    tensors = {f"module/{k}": v.detach().clone().contiguous() for k, v in module.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optimizer/{i}/{name}"] = value.detach().clone().reshape(value.shape).contiguous()
    tensors["rng/torch"] = torch.get_rng_state()
    return tensors, {k: json.dumps(v) for k, v in meta.items()}


def lightning_checkpoint() -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    class Expected(L.Callback):
        """Takes the live state right when ModelCheckpoint saves (it runs after this callback)."""

        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            optimizer = trainer.optimizers[0]
            meta = {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "lr": optimizer.param_groups[0]["lr"],
                "lightning": L.__version__,
                "torch": torch.__version__,
            }
            self.saved = expected(module, optimizer, meta)

    L.seed_everything(0, verbose=False)
    out = Path(tempfile.mkdtemp())
    take = Expected()
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, filename="lightning", every_n_epochs=2)
    mid = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, filename="lightning_mid", every_n_train_steps=3)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        callbacks=[take, save, mid],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(data(), batch_size=4))
    for name in ("lightning.ckpt", "lightning_mid.ckpt"):
        shutil.move(out / name, HERE / name)
    out.rmdir()
    tensors, meta = take.saved
    safetensors.torch.save_file(tensors, str(HERE / "lightning_expected.safetensors"), metadata=meta)


def accelerate_checkpoint() -> None:
    import accelerate

    accelerate.utils.set_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    loader = DataLoader(data(), batch_size=2, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    batches = iter(loader)
    for _ in range(3):
        x, y = next(batches)
        with accelerator.accumulate(model):  # counts accelerator.step, which save_state records
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    out = HERE / "accelerate"
    shutil.rmtree(out, ignore_errors=True)
    meta = {
        "step": accelerator.step,
        "lr": optimizer.param_groups[0]["lr"],
        "accelerate": accelerate.__version__,
        "torch": torch.__version__,
    }
    tensors, metadata = expected(accelerator.unwrap_model(model), optimizer.optimizer, meta)
    accelerator.save_state(str(out))
    safetensors.torch.save_file(tensors, str(HERE / "accelerate_expected.safetensors"), metadata=metadata)


if __name__ == "__main__":
    lightning_checkpoint()
    accelerate_checkpoint()
    for p in sorted(HERE.rglob("*")):
        if p.is_file() and p.suffix != ".py":
            print(f"{p.relative_to(HERE)}: {p.stat().st_size} bytes", file=sys.stderr)
