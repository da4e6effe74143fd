"""``StepRunner``: one training batch of a fit (forward, backward and, at an accumulation
boundary, the optimizer step), built once per epoch's batches; a base of
:class:`~torchrig.trainer.loops.Run`.

The hot path: no host-device synchronisation, losses and logged values stay tensors on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from torchrig.trainer.items import ItemWindow
from torchrig.trainer.profiler import BACKWARD, LOGGING, OPTIMIZER, STEP
from torchrig.trainer.step_hooks import StepHooks


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned."""
    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)  # a dataclass, a ModelOutput: any object with a loss tensor
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"training_step returned {type(output).__name__}; return the loss tensor, a dict with a 'loss' "
        "tensor, an object with a 'loss' tensor attribute (a dataclass), or None to skip the batch"
    )


def batch_outputs(output: Any) -> Any:
    """What ``on_train_batch_end`` gets for what ``training_step`` returned, as in Lightning: a
    loss tensor as ``{"loss": loss}``, a dict as a copy, ``None`` as ``{}`` (the loss detached in
    both); any other object (a dataclass with a ``loss``) as it is."""
    if type(output) is torch.Tensor:
        return {"loss": output.detach()}
    if output is None:
        return {}
    if isinstance(output, dict):
        loss = output.get("loss")
        return {**output, "loss": loss.detach()} if isinstance(loss, torch.Tensor) else dict(output)
    return output


class StepRunner(StepHooks):
    """The training step of a run's fit loop, automatic or manual optimization."""

    def batch_runner(self) -> Callable[[Any, int, bool], Any]:
        """``one_batch(batch, batch_idx, is_last)``: one micro-batch (forward, backward) and, at an
        accumulation boundary, the optimizer step and the step's logging; returns what
        ``training_step`` returned.

        Built at the start of each epoch's batches, so the objects it uses (the prepared module and
        optimizers, the Rig, the fit state, the metric store) are looked up once, not per batch.
        The Trainer's settings (accumulation, clipping, logging interval, schedulers, loggers) are
        read at each batch, so a callback may still change them mid-epoch.

        Inside a step each Python call costs about a microsecond, several times what it costs in a
        micro-benchmark (the step's kernels leave the caches cold for the interpreter), a sizable part
        of a small model's step. So the step's bookkeeping is written inline here, not in helpers.
        """
        tr = self.trainer
        prepared = self.prepared_module
        assert prepared is not None
        if not prepared.module.automatic_optimization:
            return self.manual_batch_runner()
        rig, state, optimizers = tr.rig, tr.fit_state, list(tr.optimizers)
        training_step = rig.strategy.step_caller(prepared, self.require_module().training_step)
        # Rig's public API, as a hand-written loop uses it; bound once per epoch, not per batch.
        # Under pipeline parallel the schedule runs the backward inside training_step (forward_loss).
        pipelined = rig.strategy.pipeline(prepared) is not None
        backward, steps = rig.backward if not pipelined else _backward_ran, [o.step for o in optimizers]
        zeros: list[Callable[..., Any]] = [o.zero_grad for o in optimizers]
        clip, schedulers, log_step = self.clip_gradients, self.step_schedulers, self.log_step
        profiler = tr.profiler
        if profiler is not None:  # the same step with its callables timed (chosen once per epoch)
            training_step, backward = profiler.wrap(STEP, training_step), profiler.wrap(BACKWARD, backward)
            steps, zeros = [profiler.wrap(OPTIMIZER, f) for f in steps], [profiler.wrap(OPTIMIZER, f) for f in zeros]
            clip, schedulers = profiler.wrap(OPTIMIZER, clip), profiler.wrap(OPTIMIZER, schedulers)
            log_step = profiler.wrap(LOGGING, log_step)

        # The module's overrides and the step's hooks, where Lightning calls them (chosen once per
        # epoch: what nobody overrides costs no call).
        backward, steps, zeros, clip, clips_always = self.overridden_step(optimizers, backward, steps, zeros, clip)
        backward, zeros = self.hooked_backward(backward), self.hooked_zero_grads(optimizers, zeros)
        before_step = [partial(h, o) for o in optimizers for h in self.hooks("on_before_optimizer_step")]
        if pipelined:  # the gradients are zeroed before training_step, whose schedule adds to them
            training_step, zeros = _pipelined_step(training_step, zeros, tr), []

        # Token-weighted steps (a dict with "num_items"): the window's count and the gradient scaling.
        items = ItemWindow(rig.world_size, rig.device, optimizers)
        finish = items.finish if profiler is None else profiler.wrap(OPTIMIZER, items.finish)

        def one_batch(batch: Any, batch_idx: int, is_last: bool) -> Any:
            accumulate = tr.accumulate_grad_batches
            if accumulate == 1:  # every batch is a boundary: no context manager, no division
                output = training_step(batch, batch_idx)
                for zero_grad in zeros:  # where Lightning zeroes: after the window's first training_step
                    zero_grad()
                if type(output) is torch.Tensor:
                    backward(output)
                elif type(output) is dict and "num_items" in output:
                    backward(items.add(output, batch_idx, 1, True))
                    finish(batch_idx)
                else:
                    loss = loss_of(output)
                    if loss is not None:
                        backward(loss)
            else:
                boundary = (batch_idx + 1) % accumulate == 0 or is_last
                with rig.no_backward_sync(prepared, enabled=not boundary):
                    output = training_step(batch, batch_idx)
                    if batch_idx % accumulate == 0:
                        for zero_grad in zeros:
                            zero_grad()
                    if type(output) is dict and "num_items" in output:
                        backward(items.add(output, batch_idx, accumulate, boundary))
                    else:
                        loss = loss_of(output)
                        if loss is not None:
                            backward(loss / accumulate)
                            items.plain_at = batch_idx
                if not boundary:
                    return output
                if items.open:  # also when this window's last batch returned None or a plain loss
                    finish(batch_idx)
            # The optimizer step: clip and step every optimizer, step the per-step schedulers.
            for hook in before_step:
                hook()
            if clips_always or tr.gradient_clip_val is not None:
                clip(prepared, optimizers)
            for step in steps:
                step()
            state.global_step += 1
            if tr.lr_scheduler_configs:
                schedulers("step", state.global_step)
            if state.global_step % tr.log_every_n_steps == 0:
                log_step()
            return output

        return one_batch

    def manual_batch_runner(self) -> Callable[[Any, int, bool], Any]:
        """``one_batch`` under manual optimization (``automatic_optimization = False``):
        ``training_step`` runs the backward passes and optimizer steps itself; each batch counts as
        one step (``global_step``, ``max_steps``, ``log_every_n_steps``). Chosen once per epoch's
        batches, so the automatic path has no branch for it."""
        tr = self.trainer
        prepared = self.prepared_module
        assert prepared is not None
        state, rig = tr.fit_state, tr.rig
        # As the wrapped module's forward (DDP), or not (FSDP2): see Strategy.manual_step_caller.
        step_caller = rig.strategy.manual_step_caller(prepared, self.require_module().training_step)
        training_step = _without_autocast_cache(step_caller) if rig.precision.is_mixed else step_caller
        log_step = self.log_step
        if tr.profiler is not None:  # the step's backward passes and optimizer steps count in training_step
            training_step, log_step = tr.profiler.wrap(STEP, training_step), tr.profiler.wrap(LOGGING, log_step)

        def one_batch(batch: Any, batch_idx: int, is_last: bool) -> Any:
            output = training_step(batch, batch_idx)
            state.global_step += 1
            if state.global_step % tr.log_every_n_steps == 0:
                log_step()
            return output

        return one_batch

    def check_manual_optimization(self) -> None:
        """Refuse, when a fit starts, the Trainer settings that step the optimizers for a module that
        steps them itself."""
        tr = self.trainer
        module = self.require_module()
        if module.automatic_optimization:
            return
        name = type(module).__name__
        if tr.rig.strategy.pipeline(module) is not None:
            raise ValueError(
                f"{name} sets automatic_optimization = False, but under pipeline_parallel the schedule runs each "
                "step's backward itself (loss = self.forward_loss(loss_fn, x, target=y) in training_step): use "
                "automatic optimization (remove automatic_optimization = False)"
            )
        if tr.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={tr.accumulate_grad_batches}) accumulates for the Trainer's own "
                f"optimizer steps, but {name} sets automatic_optimization = False: step every n-th batch in "
                "training_step (with self.no_backward_sync() around the other backward passes)"
            )
        if tr.gradient_clip_val is not None:
            raise ValueError(
                f"Trainer(gradient_clip_val={tr.gradient_clip_val}) clips at the Trainer's own optimizer steps, but "
                f"{name} sets automatic_optimization = False: call self.clip_gradients(optimizer, "
                "gradient_clip_val=...) in training_step before optimizer.step()"
            )

    def log_step(self) -> None:
        """Send the step values to the loggers (every ``log_every_n_steps`` optimizer steps)."""
        tr = self.trainer
        values: dict[str, Any] = self.train_metrics.step_values(for_logger=True)  # a fresh dict
        if values:
            values["epoch"] = tr.fit_state.epoch
            self.log_to_loggers(values)

    def clip_gradients(self, module: torch.nn.Module, optimizers: list[Any]) -> None:
        tr = self.trainer
        clip = tr.gradient_clip_val  # checked when the Trainer was built (arguments.clip_threshold)
        max_norm, clip_val = (clip, None) if tr.gradient_clip_algorithm == "norm" else (None, clip)
        for opt in optimizers:
            tr.rig.clip_gradients(module, opt, max_norm=max_norm, clip_val=clip_val)

    def step_schedulers(self, interval: str, count: int) -> None:
        tr = self.trainer
        for cfg in tr.lr_scheduler_configs:
            if cfg.interval != interval or count % cfg.frequency:
                continue
            metric = None
            if cfg.monitor is not None:
                metrics = tr.callback_metrics
                if cfg.monitor not in metrics and not cfg.strict:
                    warnings.warn(
                        f"ReduceLROnPlateau monitors {cfg.monitor!r}, which was not logged; its step is skipped "
                        f"(strict=False). Logged: {sorted(metrics) or 'none'}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                if cfg.monitor not in metrics:
                    raise ValueError(
                        f"ReduceLROnPlateau monitors {cfg.monitor!r}, which was not logged; "
                        f"logged: {sorted(metrics) or 'none'}"
                    )
                metric = float(metrics[cfg.monitor])
            self.require_module().lr_scheduler_step(cfg.scheduler, metric)  # default: scheduler.step([metric])


def _backward_ran(loss: torch.Tensor) -> None:
    """The backward under pipeline parallel: the schedule has run it inside ``training_step``
    (:meth:`TrainingModule.forward_loss`); a loss that still has a graph would lose its backward."""
    if loss.requires_grad:
        raise RuntimeError(
            "training_step returned a loss that still needs a backward, but under pipeline_parallel the schedule "
            "runs the backward inside training_step: compute the loss with loss = self.forward_loss(loss_fn, x, "
            "target=y) and put every term of it (a regulariser too) in loss_fn"
        )


def _pipelined_step(
    training_step: Callable[..., Any], zeros: list[Callable[..., Any]], trainer: Any
) -> Callable[..., Any]:
    """``training_step`` under pipeline parallel, whose schedule runs the backward: the gradients
    are zeroed before the first batch of each accumulation window (after it would lose them), and a
    token-weighted output is refused (the schedule has already averaged the microbatches' losses,
    which the count's scaling would then weight wrongly)."""

    def call(batch: Any, batch_idx: int) -> Any:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            for zero_grad in zeros:
                zero_grad()
        output = training_step(batch, batch_idx)
        if type(output) is dict and "num_items" in output:
            raise ValueError(
                "training_step returned {'loss': ..., 'num_items': ...}, but under pipeline_parallel the schedule "
                "averages the microbatches' losses before the Trainer could weight them by their items: return "
                "the loss of self.forward_loss(loss_fn, x, target=y), with loss_fn giving each microbatch's mean"
            )
        return output

    return call


def _without_autocast_cache(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` with autocast's cache of half-precision weight copies off.

    The manual step runs under one autocast region, in which autocast casts each weight once and
    reuses the copy until the region ends. After ``optimizer.step()`` inside the step that copy is
    stale: a later forward in the same step would use the old weights. Without the cache every
    forward casts the weights it uses, as when each module call is its own region (``rig.prepare``d
    modules in a hand-written loop).
    """

    def call(*args: Any) -> Any:
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return step(*args)
        finally:
            torch.set_autocast_cache_enabled(cached)

    return call
