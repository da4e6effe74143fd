"""One hook-recording module and callback, built on Lightning's base classes or on torchrig's, so
the same code runs under both Trainers and the two call sequences can be compared."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

#: Lightning methods a module can override that are not hooks of a moment (their place is
#: asserted by the tests of each override, not recorded here).
NOT_RECORDED = {"on_gpu", "configure_sharded_model"}
#: Where torchrig calls these differs from Lightning, on purpose (docs/migrating.md says why):
#: the module's own loaders are asked for after configure_optimizers, before on_fit_start.
LOADERS = {"train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"}
#: The methods Lightning users override to change what a step does (each has its own tests).
OVERRIDES = {
    "configure_callbacks",
    "optimizer_step",
    "optimizer_zero_grad",
    "lr_scheduler_step",
    "configure_gradient_clipping",
    "backward",
}
MODULE_METHODS = {"prepare_data", "setup", "configure_model", "teardown", "transfer_batch_to_device", *OVERRIDES}


def module_hook_names(base: type) -> list[str]:
    """The hooks of Lightning's LightningModule that the recorder overrides."""
    names = [n for n in dir(base) if n.startswith("on_") or n in MODULE_METHODS]
    return sorted(n for n in names if n not in NOT_RECORDED and callable(getattr(base, n)))


def callback_hook_names(base: type) -> list[str]:
    return sorted(n for n in dir(base) if n.startswith("on_") or n in ("setup", "teardown"))


def _recording(name: str, base: type, log: list[str], prefix: str) -> Callable[..., Any]:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        log.append(prefix + name)
        return getattr(base, name)(self, *args, **kwargs)

    hook.__name__ = name
    return hook


def recorder(
    module_base: type, callback_base: type, names: list[str], cb_names: list[str], manual: bool = False
) -> tuple[Any, Any, list[str]]:
    """A module and a callback whose every hook in ``names``/``cb_names`` appends its name (the
    callback's with ``cb.``) to the returned log, then does what the base class does."""
    log: list[str] = []

    def data() -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)), batch_size=2)

    class Module(module_base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.automatic_optimization = not manual

        def loss(self, batch: Any) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            log.append("training_step")
            loss = self.loss(batch)
            if manual:
                opt = self.optimizers()
                self.manual_backward(loss)
                opt.step()
                opt.zero_grad()
                return None
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            log.append("validation_step")
            self.log("val_loss", self.loss(batch))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            log.append("test_step")
            self.log("test_loss", self.loss(batch))

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            log.append("predict_step")
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            log.append("configure_optimizers")
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            log.append("train_dataloader")
            return data()

        def val_dataloader(self) -> Any:
            log.append("val_dataloader")
            return data()

        def test_dataloader(self) -> Any:
            log.append("test_dataloader")
            return data()

        def predict_dataloader(self) -> Any:
            log.append("predict_dataloader")
            return data()

    for name in names:
        setattr(Module, name, _recording(name, module_base, log, ""))

    class Recorder(callback_base):  # type: ignore[misc,valid-type]
        pass

    for name in cb_names:
        setattr(Recorder, name, _recording(name, callback_base, log, "cb."))
    return Module(), Recorder(), log


def quiet_lightning() -> None:
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


def sum_data(n: int = 16, seed: int = 0) -> DataLoader[Any]:
    """``n`` samples of 3 features whose target is their sum, in batches of 4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def linear_module(base: type) -> type:
    """A ``Linear(3, 1)`` module on Lightning's or torchrig's base, with its MSE ``loss(batch)``:
    the tests comparing the two Trainers subclass it with their own steps."""

    class Linear(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def loss(self, batch: Any) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    return Linear
