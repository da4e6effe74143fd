"""Small models and data for the Trainer tests (imported by test files in this folder)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchrig


def regression_data(n: int = 32, features: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.arange(1.0, features + 1).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loader(n: int = 32, batch_size: int = 4, shuffle: bool = False, seed: int = 0) -> DataLoader[Any]:
    return DataLoader(regression_data(n, seed=seed), batch_size=batch_size, shuffle=shuffle)


class Regressor(torchrig.TrainingModule):
    """A linear model that logs its losses; ``lr`` and ``dropout`` are configurable."""

    def __init__(self, lr: float = 0.05, dropout: float = 0.0, features: int = 4) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, 8), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), batch_size=len(x))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), batch_size=len(x))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def quiet_trainer(tmp_path: Any, **kwargs: Any) -> torchrig.Trainer:
    """A CPU Trainer without progress bar, logger or checkpointing unless asked for."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
        "num_sanity_val_steps": 0,
    }
    defaults.update(kwargs)
    return torchrig.Trainer(**defaults)


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def subprocess_env() -> dict[str, str]:
    """A child's environment: torchrig and these helpers importable, one thread, unbuffered output."""
    from conftest import python_env

    env = {k: v for k, v in python_env().items() if not k.startswith("TORCHRIG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_child(folder: Path, source: str, *args: str, timeout: float = 110) -> Any:
    """Write ``source`` into ``folder`` and run it as ``python script ARGS`` there (with
    :func:`subprocess_env`, these helpers importable); the ``CompletedProcess``, output captured."""
    import subprocess
    import sys

    script = folder / f"script_{abs(hash(source))}.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=folder,
    )


def run_script(folder: Path, source: str, *args: str, timeout: float = 110) -> None:
    """:func:`run_child`, which must exit 0."""
    done = run_child(folder, source, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def printed_json(text: str) -> list[Any]:
    """``conftest.printed_json``, imported when called (the children that import these helpers,
    and the test modules that use this, have no conftest to import)."""
    from conftest import printed_json as read

    return read(text)


def docs_example(heading: str, doc: str = "trainer_tools.md") -> str:
    """The one python block of the section ``heading`` (a ``## `` heading) of ``docs/<doc>``."""
    import re

    text = (ROOT / "docs" / doc).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    (code,) = re.findall(r"```python\n(.*?)```", text[start : end if end != -1 else len(text)], re.S)
    return code


def checkpointed_fit(
    root: Path,
    module: Any,
    callbacks: list[Any],
    train: Any = None,
    val: Any = None,
    *,
    max_epochs: int = 3,
    max_steps: int = -1,
    ckpt: Any = None,
    **kwargs: Any,
) -> torchrig.Trainer:
    """Fit ``module`` with ``callbacks`` and a checkpoint after every optimizer step (``root/ck``,
    with ``last``), stopping at ``max_steps``, or resuming from ``ckpt``: the two halves of an
    interrupted fit, to compare with an uninterrupted one (``kwargs``: more Trainer arguments)."""
    every_step = torchrig.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_last=True)
    trainer = quiet_trainer(
        root,
        max_epochs=max_epochs,
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[*callbacks, every_step],
        **kwargs,
    )
    trainer.fit(module, train, val, ckpt_path=ckpt)
    return trainer


def fit_under_lightning_and_torchrig(
    tmp_path: Path, model: Any, callback: Any, train: Any, val: Any = None, max_epochs: int = 4
) -> dict[str, tuple[Any, Any, Any]]:
    """One fit under Lightning's Trainer and one under torchrig's of the same model, data and
    callback, each seeded with 0: ``model(base)`` makes the model's class for Lightning's or
    torchrig's base class, ``callback(callbacks)`` the callback from ``lightning.pytorch.callbacks``
    or ``torchrig``, ``train()``/``val()`` the loaders. ``{"lightning": (module, trainer,
    callback), "torchrig": (...)}``; skips the test without Lightning."""
    import pytest

    pl = pytest.importorskip("lightning.pytorch")
    from hook_recording import quiet_lightning

    quiet_lightning()
    settings: dict[str, Any] = {"max_epochs": max_epochs, "enable_progress_bar": False, "logger": False}
    settings |= {"enable_checkpointing": False, "enable_model_summary": False, "num_sanity_val_steps": 0}
    runs = {}
    for name, base, callbacks, trainer_cls in (
        ("lightning", pl.LightningModule, pl.callbacks, pl.Trainer),
        ("torchrig", torchrig.TrainingModule, torchrig, torchrig.Trainer),
    ):
        torch.manual_seed(0)
        module, cb = model(base)(), callback(callbacks)
        trainer = trainer_cls(accelerator="cpu", devices=1, callbacks=[cb], default_root_dir=tmp_path, **settings)
        trainer.fit(module, train(), val() if val is not None else None)
        runs[name] = module, trainer, cb
    return runs


def lightning_trainer(tmp_path: Any, **kwargs: Any) -> Any:
    """Lightning's own Trainer on the CPU, quiet (no logger, checkpoints, bar or summary): to
    compare a torchrig feature with Lightning's on the same tiny model."""
    import lightning.pytorch as pl
    from hook_recording import quiet_lightning

    quiet_lightning()
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    defaults.update(kwargs)
    return pl.Trainer(**defaults)
