"""What the tuning tools share: training a few batches through the Trainer's Rig and putting
everything back afterwards (:class:`Restored`), and Lightning's way of finding a tuned
attribute (``batch_size``, ``lr``) on the module, its ``hparams`` or the datamodule."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from torchrig.data import RigDataLoader
from torchrig.trainer.metrics import MetricStore
from torchrig.trainer.step_runner import loss_of

if TYPE_CHECKING:
    from torchrig.trainer.datamodule import DataModule
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


def sweep_loader(tr: Trainer, train: Any) -> RigDataLoader:
    """The training data on the Rig's device and processes, for a sweep only (a prepared
    loader as it is: its position is put back afterwards)."""
    if isinstance(train, RigDataLoader):
        return train
    if not isinstance(train, DataLoader):
        raise TypeError(f"train_dataloaders must be a torch.utils.data.DataLoader; got {type(train).__name__}")
    return tr.rig.setup_dataloader(train)


def cycled(loader: Any, who: str) -> Iterator[Any]:
    """The batches of ``loader``, epoch after epoch, as long as they are asked for."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError(f"{who}: the training data gave no batch")


def one_optimizer(who: str, module: TrainingModule, optimizers: list[Any]) -> Any:
    """The one optimizer a tuner steps itself; refused for manual optimization or several."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{who} steps the optimizer itself, but {type(module).__name__} sets automatic_optimization = False"
        )
    if len(optimizers) != 1:
        raise ValueError(f"{who} steps one optimizer; configure_optimizers() returned {len(optimizers)}")
    return optimizers[0]


def train_batch(tr: Trainer, prepared: Any, optimizer: Any, batch: Any, batch_idx: int, *, who: str) -> torch.Tensor:
    """One optimizer step on ``batch`` through the Rig (the module's ``training_step``, backward,
    the Trainer's gradient clipping, step, zero_grad); the loss, on the device."""
    loss = loss_of(prepared.step_caller(prepared.module.training_step)(batch, batch_idx))
    if loss is None:
        raise ValueError(f"{who}: training_step returned None for batch {batch_idx}; it must return a loss")
    tr.rig.backward(loss)
    if tr.gradient_clip_val is not None:
        tr.run.clip_gradients(prepared, [optimizer])
    optimizer.step()
    optimizer.zero_grad()
    return loss


class Restored:
    """Puts the module's tensors, the optimizer, the precision, the loader's position (when
    given) and where logged values go back as they were when the block was entered."""

    def __init__(
        self, tr: Trainer, prepared: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loader: Any = None
    ) -> None:
        self.tr, self.module, self.optimizer, self.loader = tr, prepared, optimizer, loader

    def __enter__(self) -> None:
        tr = self.tr
        # keep_vars: the live tensors (DTensor shards under FSDP), copied back in place.
        self.tensors = list(self.module.state_dict(keep_vars=True).values())
        self.saved = [t.detach().clone() for t in self.tensors]
        self.optimizer_state = None if self.optimizer is None else deep_clone(self.optimizer.state_dict())
        self.precision_state = deep_clone(tr.rig.precision.state_dict())
        self.position = None if self.loader is None else vars(self.loader).copy()
        self.modes = [(m, m.training) for m in self.module.modules()]
        self.sink = tr.run.log_into(MetricStore(device=tr.rig.device, rig=tr.rig), in_step=True)
        self.sink.__enter__()

    def __exit__(self, *exc: Any) -> None:
        tr = self.tr
        with torch.no_grad():
            for live, saved in zip(self.tensors, self.saved, strict=True):
                live.copy_(saved)
        for p in self.module.parameters():
            p.grad = None
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(self.optimizer_state)
        tr.rig.precision.load_state_dict(self.precision_state)
        if self.position is not None:
            vars(self.loader).update(self.position)
        for m, mode in self.modes:
            m.training = mode
        self.sink.__exit__(*exc)


def deep_clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: deep_clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [deep_clone(v) for v in state]
    return state


# -- the tuned attribute ----------------------------------------------------------------------------
def holders(module: TrainingModule, datamodule: DataModule | None, name: str) -> list[Any]:
    """Where ``name`` is kept, in Lightning's order: the module, its ``hparams``, the datamodule,
    its ``hparams`` (a value is read from the last, written to all)."""
    found: list[Any] = []
    for owner in (module, datamodule):
        if owner is None:
            continue
        if hasattr(owner, name):
            found.append(owner)
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict) and name in hparams:
            found.append(hparams)
    return found


class Attribute:
    """The value a tuner changes: ``name`` on the module, its ``hparams`` or the datamodule.

    Raises:
        ValueError: none of them has ``name``.
    """

    def __init__(self, who: str, arg: str, name: str, module: TrainingModule, datamodule: DataModule | None) -> None:
        self.name = name
        self.places = holders(module, datamodule, name)
        if not self.places:
            where = f"{type(module).__name__}, its hparams" + (
                f", {type(datamodule).__name__} nor its hparams" if datamodule is not None else " nor a datamodule"
            )
            raise ValueError(
                f"{who}: {arg}={name!r} is not an attribute of {where}; give the module (or datamodule) a "
                f"{name} attribute (or save_hyperparameters() with it) that its *_dataloader() or "
                f"configure_optimizers() reads, or pass {arg}= with the name it has"
            )

    def get(self) -> Any:
        last = self.places[-1]
        return last[self.name] if isinstance(last, dict) else getattr(last, self.name)

    def set(self, value: Any) -> None:
        for place in self.places:
            if isinstance(place, dict):
                place[self.name] = value
            else:
                setattr(place, self.name, value)


def loader_maker(
    who: str, module: TrainingModule, datamodule: DataModule | None, method: str = "train_dataloader"
) -> Callable[[], Any]:
    """The ``method`` (``train_dataloader``...) a tuner asks again after changing the batch
    size: the datamodule's, else the module's."""
    owner: Any = datamodule if datamodule is not None else module
    make = getattr(owner, method, None)
    if not callable(make):
        raise ValueError(
            f"{who} changes the batch size the DataLoader is built with, so it needs the loader from "
            f"{method}() of the module or a datamodule; {type(module).__name__} defines none"
        )
    return make
