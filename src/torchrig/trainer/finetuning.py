"""``BaseFinetuning`` and ``BackboneFinetuning``: freeze part of a model, then unfreeze it mid-fit
with a parameter group of its own (Lightning 2.6's callbacks, with their names and arguments).

``freeze_before_training(module)`` runs at the fit's ``setup``, before ``configure_optimizers``
(build the optimizer over the trainable parameters only); ``finetune_function(module, epoch,
optimizer)`` runs at the start of every training epoch, once per epoch (also when a fit resumes
in the middle of one), for each optimizer, and adds parameter groups with
:meth:`BaseFinetuning.unfreeze_and_add_param_group`.

A resumed fit continues exactly: the callback keeps, in its checkpoint state, the parameter
groups of every optimizer (by parameter name) and which parameters and BatchNorm layers are
frozen; on resume it rebuilds them in ``on_restore_optimizers``, before the optimizers' saved
state (which has the added groups) is loaded into them.

Under FSDP on 2 processes the fit trains the weights of one process with the same global batches
and resumes exactly. Under DDP it is refused: torch's ``DistributedDataParallel`` reduces only
the gradients of the parameters that were trainable when it wrapped the module, so a backbone
unfrozen later would train apart on each process (Lightning lets that happen).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchrig import arguments
from torchrig.strategies import DDPStrategy
from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

log = logging.getLogger(__name__)

Modules = nn.Module | Iterable[Any]


def multiplicative(epoch: int) -> float:
    """``BackboneFinetuning``'s default ``lambda_func``: the backbone's learning rate doubles every epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Freeze modules before the fit, unfreeze them at epochs of your choosing.

    Override :meth:`freeze_before_training` (freeze with :meth:`freeze`) and
    :meth:`finetune_function` (unfreeze with :meth:`unfreeze_and_add_param_group`). Build the
    optimizer over the trainable parameters only:
    ``SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=...)``.

    Example:
        >>> class Unfreeze(BaseFinetuning):
        ...     def freeze_before_training(self, module):
        ...         self.freeze(module.features)
        ...     def finetune_function(self, module, epoch, optimizer):
        ...         if epoch == 2:
        ...             self.unfreeze_and_add_param_group(module.features, optimizer, lr=1e-3)
    """

    def __init__(self) -> None:
        #: Per optimizer index, its parameter groups with parameter names instead of parameters.
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._frozen: dict[str, list[str]] | None = None  # frozen parameters and untracked BatchNorms
        self._last_epoch = -1  # the epoch finetune_function last ran for
        self._restarting = False

    # -- the user's part ------------------------------------------------------------------------
    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        """Freeze what trains later (called at the fit's ``setup``, before ``configure_optimizers``)."""
        raise NotImplementedError(f"{type(self).__name__} must override freeze_before_training(pl_module)")

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Unfreeze what trains from ``epoch`` on (called at the start of every training epoch, per optimizer)."""
        raise NotImplementedError(f"{type(self).__name__} must override finetune_function(pl_module, epoch, optimizer)")

    # -- helpers (Lightning's static methods) --------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of ``modules`` (a module, or an iterable of modules and iterables),
        and the parents that hold parameters themselves."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable) and not isinstance(modules, nn.Module):
            found: Iterable[nn.Module] = [m for item in modules for m in BaseFinetuning.flatten_modules(item)]
        elif isinstance(modules, nn.Module):
            found = modules.modules()
        else:
            raise TypeError(f"expected an nn.Module or an iterable of them, got {type(modules).__name__}")
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm
        layers' left out with ``train_bn=False``)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for param in mod.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze the parameters of ``modules`` (BatchNorm layers track running statistics again)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm):
                mod.track_running_stats = True
            for param in mod.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze the parameters of ``module`` itself (a BatchNorm layer stops tracking statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without those ``optimizer`` has already (which are skipped, with a warning).

        Lightning compares parameters by value (``torch.equal``); torchrig by identity, so two
        parameters that happen to hold equal values are not taken for one."""
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        kept: list[nn.Parameter] = []
        skipped: list[nn.Parameter] = []
        for param in params:
            (skipped if id(param) in present else kept).append(param)
        if skipped:
            warnings.warn(
                f"{len(skipped)} of the parameters to add are in a parameter group of this optimizer already and "
                "are skipped; build the optimizer over the trainable parameters only: "
                f"{type(getattr(optimizer, 'optimizer', optimizer)).__name__}"
                "(filter(lambda p: p.requires_grad, self.parameters()), ...)",
                stacklevel=3,
            )
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: torch.optim.Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new group, with
        learning rate ``lr`` (None: the first group's divided by ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        )
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr / denom})

    # -- Trainer events ----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "fit":
            return
        if isinstance(trainer.rig.strategy, DDPStrategy) and trainer.rig.world_size > 1:
            raise ValueError(
                f"{type(self).__name__} under DDP ({trainer.rig.world_size} processes): torch's "
                "DistributedDataParallel reduces only the gradients of the parameters that were trainable when "
                "it wrapped the module, so the parameters unfrozen later would train apart on each process; "
                "use strategy='fsdp' (the same weights as one process), or one process"
            )
        self.freeze_before_training(module)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        epoch = trainer.current_epoch
        if epoch == self._last_epoch:  # a fit resumed in the middle of the epoch: done already
            return
        for index, optimizer in enumerate(trainer.optimizers):
            before = len(optimizer.param_groups)
            self.finetune_function(module, epoch, optimizer)
            self._store(module, index, before, optimizer.param_groups)
        self._last_epoch = epoch
        self._frozen = _frozen(module)

    def on_restore_optimizers(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self._restarting:
            return
        self._restarting = False
        params = dict(module.named_parameters())
        for index, groups in self._internal_optimizer_metadata.items():
            if index >= len(trainer.optimizers):
                raise ValueError(
                    f"{type(self).__name__}: the checkpoint has parameter groups for optimizer {index}, but "
                    f"configure_optimizers() returned {len(trainer.optimizers)}; resume with the same optimizers"
                )
            unknown = sorted({n for g in groups for n in g["params"]} - set(params))
            if unknown:
                raise ValueError(
                    f"{type(self).__name__}: the checkpoint's parameter groups name parameters {unknown[:4]} that "
                    f"{type(module).__name__} does not have; resume with the model the checkpoint was saved from"
                )
            trainer.optimizers[index].param_groups = _mapped(groups, params.__getitem__)
        if self._frozen is not None:
            _refreeze(module, self._frozen)

    # -- state ---------------------------------------------------------------------------------
    def _store(self, module: nn.Module, index: int, before: int, groups: list[dict[str, Any]]) -> None:
        names = {id(p): n for n, p in module.named_parameters()}  # by identity: a tensor's == is element-wise
        named = _mapped(groups, lambda p: names[id(p)])
        if index not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[index] = named
        elif before != len(groups):  # the groups finetune_function added
            self._internal_optimizer_metadata[index].extend(named[before:])

    def state_dict(self) -> dict[str, Any]:
        return {
            "internal_optimizer_metadata": self._internal_optimizer_metadata,
            "frozen": self._frozen,
            "last_epoch": self._last_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._internal_optimizer_metadata = {int(k): v for k, v in state["internal_optimizer_metadata"].items()}
        self._frozen = state.get("frozen")
        self._last_epoch = int(state.get("last_epoch", -1))
        self._restarting = True


def _mapped(groups: list[dict[str, Any]], swap: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """``groups`` (an optimizer's ``param_groups``) with each parameter ``p`` replaced by ``swap(p)``."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [swap(p) for p in g["params"]]} for g in groups]


def _frozen(module: nn.Module) -> dict[str, list[str]]:
    """What is frozen in ``module``: parameters without gradients, BatchNorms not tracking statistics."""
    return {
        "parameters": [n for n, p in module.named_parameters() if not p.requires_grad],
        "batchnorms": [n for n, m in module.named_modules() if isinstance(m, _BatchNorm) and not m.track_running_stats],
    }


def _refreeze(module: nn.Module, frozen: dict[str, list[str]]) -> None:
    """Freeze ``module`` as :func:`_frozen` found it (and nothing else)."""
    parameters, batchnorms = set(frozen["parameters"]), set(frozen["batchnorms"])
    for name, param in module.named_parameters():
        param.requires_grad = name not in parameters
    for name, mod in module.named_modules():
        if isinstance(mod, _BatchNorm):
            mod.track_running_stats = name not in batchnorms


class BackboneFinetuning(BaseFinetuning):
    """Freeze ``module.backbone`` (an ``nn.Module`` attribute) until ``unfreeze_backbone_at_epoch``,
    then train it with a learning rate of its own that grows by ``lambda_func`` every epoch.

    Args:
        unfreeze_backbone_at_epoch: the epoch (from 0) at which the backbone joins the optimizer.
        lambda_func: ``lambda_func(epoch + 1)`` multiplies the backbone's learning rate at each
            later epoch's start (default: doubles it).
        backbone_initial_ratio_lr: its first learning rate, as a fraction of the first group's.
        backbone_initial_lr: its first learning rate (instead of the ratio).
        should_align: once the backbone's rate would pass the first group's, it takes that one.
        initial_denom_lr: unused by the schedule (Lightning passes it along; kept for the signature).
        train_bn: whether the backbone's BatchNorm layers train while it is frozen and after.
        verbose: log both learning rates at each epoch's start (logger ``torchrig.trainer.finetuning``).
        rounding: digits of the logged rates.

    Example:
        >>> # configure_optimizers: torch.optim.Adam(self.head.parameters(), lr=1e-3)
        >>> # trainer = torchrig.Trainer(callbacks=[torchrig.BackboneFinetuning(unfreeze_backbone_at_epoch=5)])
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = arguments.int_in_range(
            "unfreeze_backbone_at_epoch", unfreeze_backbone_at_epoch, 0
        )
        if not callable(lambda_func):
            raise TypeError(f"BackboneFinetuning(lambda_func={lambda_func!r}) must be callable: epoch -> lr factor")
        self.lambda_func = lambda_func
        ratio, initial = backbone_initial_ratio_lr, backbone_initial_lr
        self.backbone_initial_ratio_lr = arguments.finite_at_least("backbone_initial_ratio_lr", ratio, 0.0)
        self.backbone_initial_lr = (
            None if initial is None else arguments.finite_at_least("backbone_initial_lr", initial, 0.0)
        )
        self.should_align = bool(should_align)
        self.initial_denom_lr = arguments.finite_at_least("initial_denom_lr", initial_denom_lr, 0.0)
        self.train_bn = bool(train_bn)
        self.verbose = bool(verbose)
        self.rounding = arguments.int_in_range("rounding", rounding, 0)
        self.previous_backbone_lr: float | None = None

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not isinstance(getattr(module, "backbone", None), nn.Module):
            found = type(getattr(module, "backbone", None)).__name__ if hasattr(module, "backbone") else "nothing"
            raise ValueError(
                f"BackboneFinetuning needs the module's backbone as an nn.Module attribute `backbone`; "
                f"{type(module).__name__}.backbone is {found}: set self.backbone = <the part to unfreeze later>"
            )
        super().setup(trainer, module, stage)

    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        self.freeze(pl_module.backbone, train_bn=self.train_bn)  # type: ignore[arg-type]

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            lr = self.backbone_initial_lr
            if lr is None:
                lr = current_lr * self.backbone_initial_ratio_lr
            self.unfreeze_and_add_param_group(
                pl_module.backbone,  # type: ignore[arg-type]
                optimizer,
                lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            lr = current_lr if self.should_align and lr > current_lr else lr
            optimizer.param_groups[-1]["lr"] = lr
        else:
            return
        self.previous_backbone_lr = lr
        if self.verbose:
            log.info(f"Current lr: {round(current_lr, self.rounding)}, Backbone lr: {round(lr, self.rounding)}")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_backbone_lr = state["previous_backbone_lr"]
        super().load_state_dict(state)
