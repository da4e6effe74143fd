"""``TrainingModule``: an ``nn.Module`` that also says how to train, evaluate and predict.

Its hooks (``on_fit_start``, ``on_train_batch_end``, ``prepare_data``...) are Lightning 2.6's,
with Lightning's names, arguments and order: :class:`~torchrig.trainer.hooks.ModelHooks`; the
table of when each runs is in docs/migrating.md.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from torchrig import arguments
from torchrig.trainer.hooks import ModelHooks
from torchrig.trainer.metrics import REDUCTIONS, LogOptions

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer


_M = TypeVar("_M", bound="TrainingModule")

#: One LogOptions per combination of self.log's flags (built once, not per call).
_OPTIONS: dict[tuple[Any, ...], LogOptions] = {}


class TrainingModule(nn.Module, ModelHooks):
    """Subclass it, define ``training_step`` and ``configure_optimizers``, hand it to a Trainer.

    Example:
        >>> import torch, torchrig
        >>> class Regressor(torchrig.TrainingModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(4, 1)
        ...     def forward(self, x):
        ...         return self.layer(x)
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         loss = torch.nn.functional.mse_loss(self(x), y)
        ...         self.log("train_loss", loss, prog_bar=True)
        ...         return loss
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    """

    _trainer: Trainer | None = None
    #: False: ``training_step`` steps the optimizers itself (manual optimization): it calls
    #: ``self.optimizers()``, ``self.manual_backward(loss)``, ``opt.step()`` and ``opt.zero_grad()``;
    #: the Trainer only counts the batch as a step (no accumulation, clipping or scheduler steps of
    #: its own). Set it in ``__init__``.
    automatic_optimization: bool = True

    @property
    def trainer(self) -> Trainer:
        """The Trainer running this module (an error outside a run)."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; pass it to Trainer.fit() first")
        return self._trainer

    @property
    def device(self) -> torch.device:
        """The device this process computes on (of the first parameter outside a run)."""
        if self._trainer is not None:
            return self._trainer.rig.device
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    # -- the Trainer's values, under Lightning's names --------------------------------------
    @property
    def global_step(self) -> int:
        """``trainer.global_step`` (0 outside a run)."""
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        """``trainer.current_epoch`` (0 outside a run)."""
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        """This process's rank among all (0 outside a run)."""
        return self._trainer.rig.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (0 outside a run)."""
        return self._trainer.rig.local_rank if self._trainer is not None else 0

    @property
    def logger(self) -> Any:
        """The Trainer's first logger (None without one, or outside a run)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        """The Trainer's loggers (none outside a run)."""
        return list(self._trainer.loggers) if self._trainer is not None else []

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only (``rig.print``)."""
        if self._trainer is None:
            print(*args, **kwargs)
        else:
            self._trainer.rig.print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """``rig.all_gather``: every process's tensors stacked, shape ``(world_size, *shape)``,
        also in one process (where Lightning's gives the tensor back unchanged); ``group`` is
        Lightning's and only None (every process)."""
        if group is not None:
            raise ValueError(f"self.all_gather(group={group!r}): torchrig gathers from every process; pass group=None")
        return self.trainer.rig.all_gather(data, sync_grads=sync_grads)

    def freeze(self) -> None:
        """No parameter requires gradients, and eval mode (as Lightning's)."""
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Every parameter requires gradients, and train mode (as Lightning's)."""
        for param in self.parameters():
            param.requires_grad = True
        self.train()

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles (deepcopy, ddp_spawn) leave the Trainer behind; the next run re-attaches.
        state = super().__getstate__()
        state.pop("_trainer", None)
        return state  # type: ignore[no-any-return]

    # -- hyperparameters -----------------------------------------------------------------------
    def save_hyperparameters(self, ignore: Iterable[str] = ()) -> None:
        """Record the arguments of this module's ``__init__`` (call it there) as :attr:`hparams`.

        They are logged to every logger when a fit starts, stored in the Trainer's checkpoints,
        and :meth:`load_from_checkpoint` builds the module from them. Only plain data is
        recorded (numbers, strings, bools, None, lists, tuples, dicts with str keys); any other
        argument is refused with a ValueError naming it: leave it out with ``ignore=["name"]``
        and pass it to ``load_from_checkpoint`` yourself.

        Example:
            >>> # def __init__(self, hidden: int = 64, lr: float = 1e-3):
            >>> #     super().__init__()
            >>> #     self.save_hyperparameters()      # self.hparams == {"hidden": 64, "lr": 0.001}
        """
        import inspect

        from torchrig.trainer.hparams import AttributeDict, init_arguments

        frame = inspect.currentframe()
        try:
            names = [ignore] if isinstance(ignore, str) else list(ignore)
            self.__dict__["_hparams"] = AttributeDict(init_arguments(self, frame.f_back if frame else None, names))
        finally:
            del frame

    @property
    def hparams(self) -> dict[str, Any]:
        """The hyperparameters (:meth:`save_hyperparameters`, or a dict you set); ``{}`` if none.
        Keys read as attributes too (``self.hparams.lr``)."""
        from torchrig.trainer.hparams import AttributeDict

        return self.__dict__.setdefault("_hparams", AttributeDict())  # type: ignore[no-any-return]

    @hparams.setter
    def hparams(self, values: Mapping[str, Any]) -> None:
        from torchrig.trainer.hparams import AttributeDict, check_plain

        if not isinstance(values, Mapping):
            raise TypeError(f"hparams must be a dict of plain values, got {type(values).__name__}")
        check_plain(dict(values), "hparams")
        self.__dict__["_hparams"] = AttributeDict(values)

    @classmethod
    def load_from_checkpoint(cls: type[_M], path: str | os.PathLike[str], **overrides: Any) -> _M:
        """Build this module from the hyperparameters a Trainer checkpoint stored (its
        :attr:`hparams`, with ``overrides`` on top) and load the checkpoint's weights into it.

        Read as ``rig.load`` reads: every file checked against its SHA-256, tensors through
        safetensors (a sharded FSDP checkpoint is consolidated in this process), the rest with
        ``torch.load(weights_only=True)``: nothing in the files runs as code. A malformed
        ``hparams`` entry, an argument ``__init__`` does not take, or weights that do not fit
        raise :class:`~torchrig.CheckpointError`.

        Example:
            >>> # model = MyModule.load_from_checkpoint("torchrig_logs/version_0/checkpoints/last", lr=1e-4)
        """
        from torchrig.trainer.hparams import load_from_checkpoint

        return load_from_checkpoint(cls, path, overrides)

    # -- steps --------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the loss (a scalar tensor), a dict with ``"loss"``, or None to skip the batch."""
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx) to be fitted")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no validation_step(batch, batch_idx)")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no test_step(batch, batch_idx)")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """The prediction for one batch; by default ``self(batch)``."""
        return self(batch)

    def forward_loss(self, loss_fn: Callable[..., torch.Tensor], *args: Any, target: Any) -> torch.Tensor:
        """``loss_fn(self(*args), target)``: the loss of this module's forward on ``args``.

        Write a step's loss this way and ``training_step`` runs unchanged under pipeline parallel
        (``ModelParallelStrategy(pipeline_parallel=...)``), where no rank holds the whole model:
        there, in ``training_step``, it runs the schedule over the batch cut into microbatches
        (``self(*args)`` is each stage's forward; ``loss_fn`` runs on the last stage, once per
        microbatch) with the backward, and returns the mean loss of the microbatches, detached, the
        same on every rank (the Trainer then runs no backward of its own). Under ``torch.no_grad()``
        (validation, test, predict) ``self(*args)`` runs a forward-only schedule and returns the
        output on every rank, so this is ``loss_fn(self(*args), target)`` everywhere.

        Example:
            >>> # def training_step(self, batch, batch_idx):
            >>> #     x, y = batch
            >>> #     loss = self.forward_loss(torch.nn.functional.cross_entropy, x, target=y)
            >>> #     self.log("train_loss", loss)
            >>> #     return loss
        """
        from torchrig.pipelining import pipeline_of

        if pipeline_of(self) is None or not torch.is_grad_enabled():
            return loss_fn(self(*args), target)
        trainer = self.trainer  # (manual optimization under pipeline_parallel is refused when the fit starts)
        prepared = trainer.run.prepared_module
        assert prepared is not None
        divisor = trainer.accumulate_grad_batches
        return trainer.rig.strategy.forward_backward(prepared, loss_fn, args, target, divisor)

    def configure_optimizers(self) -> Any:
        """An optimizer; a list of optimizers; ``(optimizers, schedulers)``; or a dict
        ``{"optimizer": opt, "lr_scheduler": sched or {"scheduler", "interval", "frequency", "monitor"}}``.
        """
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers() to be fitted")

    # -- manual optimization (automatic_optimization = False) --------------------------------
    def optimizers(self) -> Any:
        """The optimizers of ``configure_optimizers()`` as prepared for this run (they step through
        the precision): the optimizer itself when there is one, else a list in the order given."""
        optimizers = self.trainer.optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The LR schedulers of ``configure_optimizers()``: None, the scheduler, or a list. Under
        manual optimization you step them yourself (the Trainer does not)."""
        schedulers = [cfg.scheduler for cfg in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require gradients until :meth:`untoggle_optimizer`
        (the other optimizers' are frozen; each keeps the ``requires_grad`` it had), as in
        Lightning: a GAN's generator step then computes no discriminator gradients."""
        state: dict[torch.nn.Parameter, bool] = {}
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param not in state:
                        state[param] = param.requires_grad
                        param.requires_grad = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad = state[param]
        self._toggled_state = state

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give the other optimizers' parameters back the ``requires_grad`` they had before
        :meth:`toggle_optimizer`."""
        state: dict[torch.nn.Parameter, bool] = self.__dict__.pop("_toggled_state", {})
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for param, requires_grad in state.items():
            if id(param) not in mine:
                param.requires_grad = requires_grad

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """:meth:`toggle_optimizer` for the block, :meth:`untoggle_optimizer` after it."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def manual_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` through the run's precision (scaled under ``16-mixed``) and strategy
        (the gradients are averaged across processes, also for a second backward in one step).

        Only under manual optimization: with ``automatic_optimization = True`` the Trainer runs the
        backward of the loss ``training_step`` returns.
        """
        trainer = self.trainer
        if self.automatic_optimization:
            raise RuntimeError(
                f"{type(self).__name__}.manual_backward() is for manual optimization: set "
                "self.automatic_optimization = False in __init__, or return the loss from training_step"
            )
        prepared = trainer.run.prepared_module
        if prepared is not None and not trainer.run.skip_backward_sync:
            trainer.rig.strategy.prepare_for_backward(prepared._forward_module, loss)
        trainer.run.emit("on_before_backward", loss)
        self.backward(trainer.rig.precision.scaled(loss), **kwargs)  # default: loss.backward()
        trainer.run.emit("on_after_backward")

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
    ) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first under ``16-mixed``):
        to a total norm of ``gradient_clip_val`` (``"norm"``; returns the norm before clipping) or
        each element to ``[-gradient_clip_val, gradient_clip_val]`` (``"value"``). None clips nothing."""
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; use 'norm' or 'value'")
        if gradient_clip_val is None:
            return None
        clip = arguments.clip_threshold("gradient_clip_val", gradient_clip_val)
        max_norm, clip_val = (clip, None) if gradient_clip_algorithm == "norm" else (None, clip)
        return self.trainer.rig.clip_gradients(self, optimizer, max_norm=max_norm, clip_val=clip_val)

    @contextlib.contextmanager
    def no_backward_sync(self, enabled: bool = True) -> Iterator[None]:
        """Inside the block ``manual_backward`` does not synchronise gradients across processes
        (accumulate micro-batches locally; the next backward outside the block averages their sum).

        Example:
            >>> # with self.no_backward_sync(enabled=not last_micro_batch):
            >>> #     self.manual_backward(loss)
        """
        trainer = self.trainer
        skipping = trainer.run.skip_backward_sync
        prepared = trainer.run.prepared_module
        # The strategy's own switch too (FSDP2 reduce-scatters at the end of each backward unless
        # told not to); an outer block already holds it.
        no_sync = (
            trainer.rig.no_backward_sync(prepared, enabled)
            if prepared is not None and not skipping
            else contextlib.nullcontext()
        )
        trainer.run.skip_backward_sync = skipping or enabled
        try:
            with no_sync:
                yield
        finally:
            trainer.run.skip_backward_sync = skipping

    # -- logging -----------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[..., Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Log a scalar. It stays on the device; loggers and callbacks read it later.

        Args:
            name: the metric's name (``val_loss``, ``train/acc``...).
            value: a scalar tensor or a number.
            prog_bar: show it in the progress bar.
            logger: send it to the logger.
            on_step: record the value of each step (default: True in ``training_step``, else False).
            on_epoch: record the epoch mean (default: False in ``training_step``, else True).
            reduce_fx: how the epoch's values are reduced: ``"mean"`` (weighted by ``batch_size``),
                ``"sum"``, ``"max"``, ``"min"``, or ``torch.mean``/``sum``/``max``/``min``.
            enable_graph: Lightning's; only False (values are kept detached).
            sync_dist: reduce across processes with ``reduce_fx`` (step values when logged, epoch
                values when reduced).
            sync_dist_group: Lightning's; only None (every process).
            add_dataloader_idx: Lightning's; only True (with several evaluation loaders each
                loader's values are kept apart as ``name/dataloader_idx_N``).
            batch_size: the weight of this value in the epoch mean (default: the batch's size,
                the first dimension of its first tensor, as Lightning infers it).
            metric_attribute: Lightning's, for torchmetrics objects; only None (log tensors).
            rank_zero_only: Lightning's; the value is logged as it is (it is not reduced across
                processes, so ``sync_dist`` must be False).
        """
        trainer = self._trainer
        if trainer is None:
            warnings.warn(f"self.log({name!r}) outside a Trainer run is ignored", stacklevel=2)
            return
        # One small tuple and one dict lookup per call: the options object is built once per flags.
        sink = trainer.run.sink  # where the running loop's block sends values (RunState.log_into)
        key = (prog_bar, logger, on_step, on_epoch, sync_dist, sink.in_step, reduce_fx)
        options = _OPTIONS.get(key) if not (enable_graph or sync_dist_group or metric_attribute) else None
        if options is None or not add_dataloader_idx or rank_zero_only:
            _refuse_lightning_only(name, enable_graph, sync_dist_group, add_dataloader_idx, metric_attribute)
            _refuse_lightning_only_sync(name, rank_zero_only, sync_dist)
            options = _log_options(name, prog_bar, logger, on_step, on_epoch, sync_dist, sink.in_step, reduce_fx)
        if batch_size is None and options.on_epoch and options.reduce_fx == "mean":
            batch_size = sink.batch_size()  # the batch's size, as Lightning weighs an epoch mean
        # With several eval loaders, each loader's values are kept apart (``name/dataloader_idx_N``).
        sink.store.log(name + sink.suffix, value, options, batch_size)

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        """``self.log(name, value, **kwargs)`` for each item."""
        for name, value in values.items():
            self.log(name, value, **kwargs)


def _log_options(
    name: str,
    prog_bar: bool,
    logger: bool,
    on_step: bool | None,
    on_epoch: bool | None,
    sync_dist: bool,
    in_step: bool,
    reduce_fx: Any,
) -> LogOptions:
    """The (cached) LogOptions of one combination of ``self.log`` flags, in or out of a training step."""
    step = in_step if on_step is None else on_step
    epoch = (not in_step) if on_epoch is None else on_epoch
    if not (step or epoch):
        raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) records nothing; set one to True")
    reduce = _REDUCE_FX.get(reduce_fx) if isinstance(reduce_fx, str) or callable(reduce_fx) else None
    if reduce is None:
        raise ValueError(
            f"self.log({name!r}, reduce_fx={reduce_fx!r}): torchrig reduces with 'mean', 'sum', 'max' or 'min' "
            "(or torch.mean, torch.sum, torch.max, torch.min); reduce another way in on_*_epoch_end and log the result"
        )
    options = LogOptions(bool(prog_bar), bool(logger), bool(step), bool(epoch), bool(sync_dist), reduce)
    return _OPTIONS.setdefault((prog_bar, logger, on_step, on_epoch, sync_dist, in_step, reduce_fx), options)


#: ``reduce_fx`` as Lightning takes it (a name or torch's function) -> the reduction's name.
_REDUCE_FX: dict[Any, str] = {
    **{name: name for name in REDUCTIONS},
    torch.mean: "mean",
    torch.sum: "sum",
    torch.max: "max",
    torch.min: "min",
}


def _refuse_lightning_only(
    name: str, enable_graph: bool, sync_dist_group: Any, add_dataloader_idx: bool, metric_attribute: str | None
) -> None:
    """Refuse the ``self.log`` arguments of Lightning torchrig does not do, naming what to do instead."""
    refused = {
        "enable_graph=True": (enable_graph, "values are kept detached; keep the tensor yourself to backpropagate"),
        f"sync_dist_group={sync_dist_group!r}": (
            sync_dist_group is not None,
            "sync_dist reduces across every process; reduce over a group yourself with torch.distributed",
        ),
        "add_dataloader_idx=False": (
            not add_dataloader_idx,
            "with several evaluation loaders each loader's values are kept apart as name/dataloader_idx_N",
        ),
        f"metric_attribute={metric_attribute!r}": (
            metric_attribute is not None,
            "log a tensor (a torchmetrics metric's metric.compute() in on_*_epoch_end)",
        ),
    }
    for argument, (given, instead) in refused.items():
        if given:
            raise ValueError(f"self.log({name!r}, {argument}) is not supported by torchrig: {instead}")


def _refuse_lightning_only_sync(name: str, rank_zero_only: bool, sync_dist: bool) -> None:
    if rank_zero_only and sync_dist:
        raise ValueError(
            f"self.log({name!r}, rank_zero_only=True, sync_dist=True): a value logged on rank 0 only cannot be "
            "reduced across processes; drop one of the two"
        )
