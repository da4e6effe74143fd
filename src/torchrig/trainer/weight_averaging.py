"""``WeightAveraging`` and ``StochasticWeightAveraging``: Lightning 2.6's weight-averaging
callbacks, with their names and arguments, built on ``torch.optim.swa_utils`` (``AveragedModel``,
``SWALR``, ``update_bn``).

The averaged model (an ``AveragedModel``, its ``n_averaged`` counter included) is saved in every
checkpoint the Trainer writes, as the module entry ``<callback>.average``, and loaded back in
place on resume; the callbacks' counters travel in their state. A resumed fit ends bitwise equal
to an uninterrupted one.

Under FSDP the module's parameters are shards; neither callback supports that (as in Lightning)
and both refuse it: use :class:`~torchrig.EMA` there.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from torchrig import arguments
from torchrig.trainer.callbacks import Callback, EventSchedule
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.optim_config import SchedulerConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrig.trainer.trainer import Trainer

#: The name of the averaged model in a checkpoint: the entry ``<state_key>.average``.
ENTRY = "average"


class WeightAveraging(Callback):
    """Keep an ``AveragedModel`` of the module, updated after optimizer steps (or epochs) of your
    choosing; validate with it during the fit, and leave it in the module when the fit ends.

    Args:
        device: where the average lives (None: where the module is).
        use_buffers: average the buffers too (BatchNorm's statistics); False keeps the module's own.
        kwargs: for ``torch.optim.swa_utils.AveragedModel``: ``avg_fn`` or ``multi_avg_fn``
            (default: the equal-weight mean, stochastic weight averaging).

    Override :meth:`should_update` to choose when the average is updated: after every optimizer
    step by default.

    Example:
        >>> from torch.optim.swa_utils import get_ema_multi_avg_fn
        >>> class EMAFrom100(WeightAveraging):
        ...     def __init__(self):
        ...         super().__init__(multi_avg_fn=get_ema_multi_avg_fn(0.999))
        ...     def should_update(self, step_idx=None, epoch_idx=None):
        ...         return step_idx is not None and step_idx >= 100
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any) -> None:
        self._device = torch.device(device) if isinstance(device, str) else device
        if not isinstance(use_buffers, bool):
            raise TypeError(f"{type(self).__name__}(use_buffers={use_buffers!r}) must be True or False")
        unknown = sorted(set(kwargs) - {"avg_fn", "multi_avg_fn"})
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got {unknown}; AveragedModel's keyword arguments are avg_fn, multi_avg_fn"
            )
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average_model: AveragedModel | None = None
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update the average after the optimizer step ``step_idx`` (counted from 0) or
        at the end of epoch ``epoch_idx`` (one of them is given). Default: after every step."""
        return step_idx is not None

    # -- the average ---------------------------------------------------------------------------
    def _average(self, module: nn.Module) -> AveragedModel:
        """The averaged model, made from ``module`` as it is now if there is none yet."""
        if self._average_model is None:
            device = self._device if self._device is not None else next(module.parameters()).device
            self._average_model = AveragedModel(module, device=device, use_buffers=self._use_buffers, **self._kwargs)
        return self._average_model

    def _tensors(self, module: nn.Module, buffers: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The averaged and the live tensors, in pairs: parameters, and buffers with ``buffers``."""
        average = self._average(module).module
        if not buffers:
            return list(average.parameters()), list(module.parameters())
        return (
            list(itertools.chain(average.parameters(), average.buffers())),
            list(itertools.chain(module.parameters(), module.buffers())),
        )

    @torch.no_grad()
    def _copy_average_to_current(self, module: nn.Module, buffers: bool = True) -> None:
        averaged, live = self._tensors(module, buffers)
        for a, p in zip(averaged, live, strict=True):
            p.copy_(a.to(p.device))

    @torch.no_grad()
    def _swap_models(self, module: nn.Module) -> None:
        averaged, live = self._tensors(module, self._use_buffers)
        for a, p in zip(averaged, live, strict=True):
            kept = p.clone()
            p.copy_(a.to(p.device))
            a.copy_(kept.to(a.device))

    # -- Trainer events ----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit" and trainer.rig.strategy.sharded:
            raise ValueError(
                f"{type(self).__name__} keeps a whole copy of the module (torch's AveragedModel), which a sharded "
                f"strategy ({type(trainer.rig.strategy).__name__}) cannot give it; use torchrig.EMA, which averages "
                "each process's shards (EMA(swa_start=N) for equal weights)"
            )
        if stage == "fit":
            self._average_model = None  # each fit averages afresh (a resume loads its average in place)
            self._latest_update_step, self._latest_update_epoch = 0, -1

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._average(module)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._average(module).update_parameters(module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._average(module).update_parameters(module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._copy_average_to_current(module)

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._average_model is not None:
            self._swap_models(module)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._average_model is not None:
            self._swap_models(module)

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_modules(self, trainer: Trainer) -> dict[str, nn.Module]:
        if trainer.run.stage != "fit":
            return {}
        return {ENTRY: self._average(trainer.run.require_module())}

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._latest_update_step = int(state["latest_update_step"])
        self._latest_update_epoch = int(state.get("latest_update_epoch", -1))


class StochasticWeightAveraging(WeightAveraging):
    """Stochastic weight averaging as Lightning's callback does it: from epoch ``swa_epoch_start``
    on, the learning rate follows ``SWALR`` towards ``swa_lrs`` (replacing the module's scheduler)
    and the weights at the start of every epoch are averaged; when the fit has run all its
    epochs the average goes into the module and BatchNorm statistics are computed for it.

    Args:
        swa_lrs: the SWA learning rate: one float for every parameter group, or one per group.
        swa_epoch_start: the epoch (counted from 1) SWA starts at, or a fraction in ``[0, 1]`` of
            ``max_epochs`` (``int(fraction * max_epochs)``).
        annealing_epochs: epochs of ``SWALR``'s annealing from the optimizer's rate to ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"``.
        avg_fn: ``avg_fn(averaged, current, n_averaged)``, the new average (default: equal weights).
        device: where the average lives (default the CPU; None: where the module is).

    Differences from Lightning: BatchNorm statistics are computed at the fit's end by
    ``torch.optim.swa_utils.update_bn`` over the training loader (the module's ``forward`` on the
    first element of each batch, one pass), where Lightning trains one more epoch without
    backward passes; ``trainer.current_epoch`` and ``global_step`` do not move for it.
    """

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        device: torch.device | str | None = torch.device("cpu"),  # Lightning's default
    ) -> None:
        if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float)):
            raise TypeError(f"swa_epoch_start={swa_epoch_start!r}: give an epoch (int >= 1) or a fraction in [0, 1]")
        if isinstance(swa_epoch_start, int):
            arguments.int_in_range("swa_epoch_start", swa_epoch_start, 1, hint=" (epochs are counted from 1 here)")
        elif not 0 <= swa_epoch_start <= 1:
            raise ValueError(
                f"swa_epoch_start={swa_epoch_start!r}: a float is a fraction of max_epochs in [0, 1]; "
                "give an int for an epoch"
            )
        lrs = swa_lrs if isinstance(swa_lrs, list) else [swa_lrs]
        if not lrs or not all(isinstance(lr, float) and lr > 0 for lr in lrs) or not isinstance(swa_lrs, (float, list)):
            raise ValueError(
                f"swa_lrs={swa_lrs!r}: give a positive float, or a list of positive floats (one per group)"
            )
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(f"annealing_strategy={annealing_strategy!r}: use 'cos' or 'linear'")
        if avg_fn is not None and not callable(avg_fn):
            raise TypeError(f"avg_fn={avg_fn!r} must be callable: (averaged, current, n_averaged) -> new average")
        super().__init__(device=device, use_buffers=False, **({} if avg_fn is None else {"avg_fn": avg_fn}))
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = arguments.int_in_range("annealing_epochs", annealing_epochs, 1)
        self._annealing_strategy = annealing_strategy
        self._initialized = False

    def event_schedule(self, event: str) -> EventSchedule:
        # The average is updated at epoch starts only, and validation runs on the trained weights.
        per_step = ("on_train_batch_end", "on_train_epoch_end", "on_validation_epoch_start", "on_validation_epoch_end")
        return EventSchedule(enabled=event not in per_step)

    def swa_start(self, trainer: Trainer) -> int:
        """The first epoch (from 0) the average takes in."""
        start = self._swa_epoch_start
        if isinstance(start, float):
            if trainer.max_epochs == -1:
                raise ValueError(
                    f"StochasticWeightAveraging(swa_epoch_start={start}) is a fraction of max_epochs, but "
                    "max_epochs=-1: give swa_epoch_start as an epoch (int)"
                )
            start = int(trainer.max_epochs * start)
        return max(start - 1, 0)

    def swa_end(self, trainer: Trainer) -> float:
        """The last epoch (from 0) the average takes in."""
        return float("inf") if trainer.max_epochs == -1 else trainer.max_epochs - 1

    # -- Trainer events ----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        super().setup(trainer, module, stage)
        if stage == "fit":
            self._initialized = False

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(
                f"StochasticWeightAveraging works with one optimizer and at most one LR scheduler; "
                f"configure_optimizers() returned {len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}"
            )
        self.swa_start(trainer)  # a fraction of max_epochs=-1 is refused now, not at the first epoch
        super().on_fit_start(trainer, module)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        epoch = trainer.current_epoch
        if not self.swa_start(trainer) <= epoch <= self.swa_end(trainer):
            return
        if not self._initialized:
            self._install_scheduler(trainer)
        if epoch > self._latest_update_epoch:
            self._average(module).update_parameters(module)
            self._latest_update_epoch = epoch

    def _install_scheduler(self, trainer: Trainer) -> None:
        """``SWALR`` in place of the module's scheduler (the first epoch of SWA, or a resume after it)."""
        optimizer = trainer.optimizers[0]
        lrs = self._swa_lrs if isinstance(self._swa_lrs, list) else [self._swa_lrs] * len(optimizer.param_groups)
        if len(lrs) != len(optimizer.param_groups):
            raise ValueError(
                f"StochasticWeightAveraging(swa_lrs={self._swa_lrs}) gives {len(lrs)} learning rates for an optimizer "
                f"with {len(optimizer.param_groups)} parameter groups; give one per group, or one float"
            )
        for lr, group in zip(lrs, optimizer.param_groups, strict=True):
            group["initial_lr"] = lr
        scheduler = SWALR(
            optimizer,
            swa_lr=lrs,  # type: ignore[arg-type]  # one per group: torch's SWALR takes a list too
            anneal_epochs=self._annealing_epochs,
            anneal_strategy=self._annealing_strategy,  # type: ignore[arg-type]  # checked in __init__
            last_epoch=trainer.max_epochs if self._annealing_strategy == "cos" else -1,
        )
        config = SchedulerConfig(scheduler)  # every epoch
        if trainer.lr_scheduler_configs:
            trainer.lr_scheduler_configs[0] = config
        else:
            trainer.lr_scheduler_configs.append(config)
        self._initialized = True

    def on_restore_optimizers(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._initialized:  # the saved run had swapped in SWALR: its saved state loads into this one
            self._install_scheduler(trainer)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        done = trainer.max_epochs == -1 or trainer.current_epoch - 1 == self.swa_end(trainer)
        if not done or self._average_model is None or int(self._average_model.n_averaged) == 0:
            return
        self._copy_average_to_current(module, buffers=False)
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
            loader = trainer.run.train_loader  # the DataLoader inside: its position in the fit stays as it is
            update_bn(getattr(loader, "loader", loader), module, device=trainer.rig.device)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "initialized": self._initialized}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._initialized = bool(state["initialized"])
