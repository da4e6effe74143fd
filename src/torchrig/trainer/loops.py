"""The loops a Trainer runs: fit (epochs of batches, with validation), evaluation and predict.

Everything that touches devices, precision or processes goes through the Trainer's ``Rig``.
The hot path (one training batch) does no host-device synchronisation: losses and logged
values stay tensors on the device.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NoReturn

import torch

from torchrig.data import length_of
from torchrig.preemption import Preempted
from torchrig.trainer.items import ItemWindow
from torchrig.trainer.metrics import MetricStore, to_floats
from torchrig.trainer.profiler import BACKWARD, DATA, LOGGING, OPTIMIZER, STEP, VALIDATION
from torchrig.trainer.step_hooks import StepHooks


@dataclass
class FitState:
    """Where a fit is; saved in checkpoints so a resumed fit continues at the next batch."""

    epoch: int = 0
    batch_idx: int = 0  # batches of ``epoch`` already trained
    global_step: int = 0
    epoch_finished: bool = False  # the epoch-end work of ``epoch`` is done
    val_pending: bool = False  # the validation after batch ``batch_idx`` has not run yet

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


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


def num_batches(loader: Any, limit: int | float) -> int | float:
    """How many batches of ``loader`` a loop runs under ``limit_*_batches``."""
    length = length_of(loader)
    if isinstance(limit, int):
        return min(limit, length)
    if math.isinf(length):
        if limit == 1.0:
            return length
        raise ValueError(
            f"limit_*_batches={limit} is a fraction, but the dataloader has no length; give an int number of batches"
        )
    return int(length * limit)


class Run(StepHooks):
    """A Trainer's run (its state: :class:`~torchrig.trainer.run.RunState`) and the loops it runs:
    :meth:`fit`, :meth:`evaluate` and :meth:`predict`. ``self.trainer`` (``tr`` in the loops) is
    the configuration and the values users read; everything alive only while the run goes is
    on ``self``."""

    # -- fit ----------------------------------------------------------------------------------
    def check_training_batches(self) -> None:
        """Refuse, before the first epoch, a training loader that gives some process no batch.

        Otherwise the fit runs ``max_epochs`` empty epochs (every epoch-end hook, scheduler and
        validation) and trains nothing. Every process takes part in the decision (once per fit), so
        a sampler that leaves one rank empty stops every rank, not only that one.
        ``limit_train_batches=0`` asks for no training and is left alone.
        """
        tr = self.trainer
        n = tr.num_training_batches
        empty_here = n == 0 and tr.limit_train_batches != 0
        if tr.rig.reduce_boolean_decision(empty_here, all=False):
            raise self.no_batches_error(empty_here)

    def no_batches_error(self, empty_here: bool) -> ValueError:
        """The error for a training loader that gave this process (or another one) no batch."""
        tr = self.trainer
        loader = self.train_loader
        inner = getattr(loader, "loader", loader)
        dataset = getattr(inner, "dataset", None)
        samples = length_of(dataset)
        size = "a dataset" if math.isinf(samples) else f"{samples} samples"
        batching = f"batch_size={getattr(inner, 'batch_size', None)}, drop_last={getattr(inner, 'drop_last', False)}"
        world = tr.rig.world_size
        if not empty_here:
            where = f" on another of the {world} processes"
        else:
            where = f" on process {tr.rig.global_rank} of {world}" if world > 1 else ""
        limited = empty_here and 0 < length_of(loader) < math.inf
        limit = f" under limit_train_batches={tr.limit_train_batches}" if limited else ""
        return ValueError(
            f"train_dataloaders has 0 batches{where}{limit} ({size}, {batching}), so the fit would train nothing. "
            "Common causes: a dataset smaller than batch_size with drop_last=True; an empty dataset; with several "
            "processes, a sampler that leaves a process's share of the dataset empty; a limit_train_batches fraction "
            "that rounds down to 0."
        )

    def fit(self) -> None:
        """Sanity check, then epochs until ``max_epochs``, ``max_steps``, ``max_time`` or a stop."""
        tr = self.trainer
        state = tr.fit_state
        self.check_manual_optimization()
        self.stop_held = False
        if not self.resumed and tr.num_sanity_val_steps != 0 and self.has_validation():
            limit = math.inf if tr.num_sanity_val_steps == -1 else tr.num_sanity_val_steps
            self.sanity_checking = True
            try:
                self.emit("on_sanity_check_start")
                self.evaluate("sanity_check", limit_override=limit)
                self.emit("on_sanity_check_end")
            finally:
                self.sanity_checking = False
        if not self.require_module().automatic_optimization:
            self.hook_manual_steps()
        self.emit("on_train_start")
        self.started_at = time.monotonic()
        self.sparse_due = 0.0  # the sparse batch-end hooks see the first batch
        if state.epoch_finished:
            state.epoch, state.batch_idx, state.epoch_finished = state.epoch + 1, 0, False
        profiler = tr.profiler
        if profiler is not None:
            profiler.start(tr)
        try:
            while not self.fit_done():
                found = self.signals.poll()  # a stop signal between epochs: the state is an epoch's end
                if found:
                    stop_at_step(found)
                self.train_epoch()
                state.epoch, state.batch_idx, state.epoch_finished = state.epoch + 1, 0, False
                if tr.should_stop and self.may_stop(state.epoch):
                    break
        finally:  # also when the fit stops on an error or a signal: the profiler reports what it saw
            if profiler is not None:
                profiler.stop(tr)
        self.emit("on_train_end")

    def may_stop(self, epochs_done: int) -> bool:
        """Whether the fit may end now that a stop was asked for (``should_stop``), ``epochs_done``
        epochs complete: not before ``min_epochs`` and ``min_steps``. A stop that is held is
        forgotten (``should_stop`` goes back to False; whoever asked may ask again) and said once."""
        tr = self.trainer
        if epochs_done >= tr.min_epochs and tr.fit_state.global_step >= tr.min_steps:
            return True
        tr.should_stop = False
        if not self.stop_held:
            self.stop_held = True
            tr.rig.print(
                f"torchrig: a stop was asked for after {epochs_done} epochs and {tr.fit_state.global_step} steps; "
                f"the fit goes on to min_epochs={tr.min_epochs} and min_steps={tr.min_steps}"
            )
        return False

    def fit_done(self) -> bool:
        tr = self.trainer
        if tr.max_steps != -1 and tr.fit_state.global_step >= tr.max_steps:
            return True
        return tr.max_epochs != -1 and tr.fit_state.epoch >= tr.max_epochs

    def train_epoch(self) -> None:
        tr = self.trainer
        state = tr.fit_state
        if state.batch_idx == 0 and not state.val_pending and self.reload_due(state.epoch):
            self.reload_loaders()
        loader = self.train_loader
        assert loader is not None
        n = tr.num_training_batches
        if state.batch_idx == 0 and not state.val_pending:
            self.train_metrics.reset()
        self.emit("on_train_epoch_start")  # also for the epoch a fit resumes into, as Lightning
        if state.val_pending:  # resumed right after a batch whose validation did not run yet
            self.validate_in_fit()
        if state.batch_idx < n and not (tr.should_stop and self.may_stop(state.epoch)):
            if state.batch_idx == 0:
                loader.set_epoch(state.epoch)  # a resumed mid-epoch loader already knows where it is
            # Without a length, the last batch of a partial accumulation window is known only by
            # reading one batch ahead; without accumulation nothing needs it (and the stream's
            # batches are made when the loop asks, as in a hand-written loop).
            loader.look_ahead = tr.accumulate_grad_batches > 1
            loader.epoch_limit = n  # a limited epoch's last batch reads nothing after it
            # Starting the epoch's iterator (workers, a sampler's shuffle) is data loading too.
            batches = iter(loader) if tr.profiler is None else tr.profiler.wrap(DATA, iter)(loader)
            try:
                self.run_batches(batches, n)
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
            if state.batch_idx == 0 and math.isinf(n):  # a loader without a length that gave nothing
                raise self.no_batches_error(True)
        self.end_train_epoch()

    def run_batches(self, batches: Iterator[Any], n: int | float) -> None:
        tr = self.trainer
        state = tr.fit_state
        validate_epoch = self.has_validation() and (state.epoch + 1) % tr.check_val_every_n_epoch == 0
        val_every = self.val_check_batches(n) if validate_epoch else 0  # asked only when a check is scheduled
        one_batch, validate = self.batch_runner(), self.validate_in_fit
        if tr.profiler is not None:  # once per epoch: the same loop, its callables timed
            batches, validate = tr.profiler.wrap_batches(batches), tr.profiler.wrap(VALIDATION, validate)
        batch_idx = state.batch_idx
        if batch_idx >= n:
            return
        # A loader without a length reads one batch ahead and says which batch is the epoch's last.
        ends = self.train_loader if math.isinf(length_of(self.train_loader)) else None
        with self.log_into(self.train_metrics, in_step=True):
            due = self.batch_loop(
                batches, n, batch_idx, one_batch, validate, validate_epoch, val_every, self.sparse_due, ends
            )
        self.sparse_due = due

    def batch_loop(
        self,
        batches: Iterator[Any],
        n: int | float,
        batch_idx: int,
        one_batch: Callable[[Any, int, bool], Any],
        validate: Callable[[], None],
        validate_epoch: bool,
        val_every: int | float,
        due: float,
        ends: Any = None,
    ) -> float:
        """The batches of one epoch (inside the training step's log sink); when the sparse hooks are next due.

        ``ends``: the loader of an epoch without a length, whose ``at_last_batch`` says when the
        batch it gave out is the epoch's last (when it reads one batch ahead, under accumulation);
        the epoch's last batch then ends an accumulation window, as the last of ``n`` batches does.

        Worked out once per epoch, not per batch: the hot loop only calls what does something.
        Callbacks that want the batch end at most every so many seconds (``sparse``, see
        :meth:`Callback.event_schedule`) get it then (a clock read per batch, not a Python call) and
        always for the last batch the loop runs.
        """
        tr = self.trainer
        state = tr.fit_state
        batch_start, batch_end = self.hooks("on_train_batch_start"), self.hooks("on_train_batch_end")
        sparse, interval = self.sparse_batch_end()
        clock, timed, val_at_last = time.perf_counter, tr.max_time is not None, isinstance(tr.val_check_interval, float)
        poll, stop = self.signals.poll, 0
        for batch in self.transferred(batches, 0):
            is_last = batch_idx + 1 >= n or (ends is not None and ends.at_last_batch)
            for hook in batch_start:
                hook(batch, batch_idx)
            output = one_batch(batch, batch_idx, is_last)
            state.batch_idx = batch_idx + 1
            if validate_epoch:
                state.val_pending = state.batch_idx % val_every == 0 or (is_last and val_at_last)
            for hook in batch_end:
                hook(output, batch, batch_idx)
            if state.val_pending:
                validate()
            if timed and self.time_is_up():
                tr.should_stop = True
            if not stop:
                stop = poll()  # collective: the same batches on every rank
            # Inside an epoch only max_steps (of fit_done's limits), a stop or a stop signal can end the fit.
            halt = tr.should_stop and self.may_stop(state.epoch + is_last)
            final = is_last or halt or stop or (tr.max_steps != -1 and state.global_step >= tr.max_steps)
            if sparse and (final or clock() >= due):  # after this batch's validation, if any
                for hook in sparse:
                    hook(output, batch, batch_idx)
                due = clock() + interval
            if final:
                if stop:  # stop at an optimizer step, where a checkpoint is exact
                    if state.batch_idx % tr.accumulate_grad_batches and not is_last:
                        batch_idx += 1
                        continue
                    stop_at_step(stop)
                break
            batch_idx += 1
        else:  # the iterator ended: a loader without a length (not read ahead) has reached its epoch's end
            if val_at_last and validate_epoch and math.isinf(n) and state.batch_idx and not state.val_pending:
                state.val_pending = True
                validate()
        return due

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
                if cfg.monitor not in metrics:
                    raise ValueError(
                        f"ReduceLROnPlateau monitors {cfg.monitor!r}, which was not logged; "
                        f"logged: {sorted(metrics) or 'none'}"
                    )
                metric = float(metrics[cfg.monitor])
            self.require_module().lr_scheduler_step(cfg.scheduler, metric)  # default: scheduler.step([metric])

    def validate_in_fit(self) -> None:
        self.evaluate("validate")
        self.trainer.fit_state.val_pending = False

    def end_train_epoch(self) -> None:
        tr = self.trainer
        with self.log_into(self.train_metrics):  # the callbacks that do not read the epoch's metrics, the module
            for hook in self.hooks("on_train_epoch_end", monitoring=False):
                hook()
        epoch_values = self.train_metrics.epoch_values()
        self.epoch_metrics.update(epoch_values)
        logged = self.train_metrics.logger_keys(epoch_values)
        if logged:
            self.log_to_loggers({**logged, "epoch": tr.fit_state.epoch})
        if self.require_module().automatic_optimization:  # manual optimization steps its own schedulers
            self.step_schedulers("epoch", tr.fit_state.epoch + 1)
        tr.fit_state.epoch_finished = True
        for hook in self.hooks("on_train_epoch_end", monitoring=True):  # checkpointing, early stopping
            hook()

    # -- evaluation and predict ---------------------------------------------------------------
    def evaluate(self, stage: str, limit_override: float | None = None) -> list[dict[str, torch.Tensor]]:
        """Run ``validation_step``/``test_step`` over the stage's loaders; the epoch metrics per loader."""
        loaders = self.eval_loaders[stage if stage != "sanity_check" else "validate"]
        prepared = self.prepared_module
        assert prepared is not None
        method = prepared.module.test_step if stage == "test" else prepared.module.validation_step
        hook = _HOOK_STAGE[stage]
        store = self.eval_metrics
        store.reset()
        with self.log_into(store):
            if stage == "validate" and self.stage == "fit":
                self.emit("on_validation_model_zero_grad")
            self.emit(f"on_{hook}_model_eval")
            self.emit(f"on_{hook}_start")
            self.emit("on_eval_start", stage)
            self.emit(f"on_{hook}_epoch_start")
            with self.eval_context():
                for idx, loader in enumerate(loaders):
                    n = num_batches(loader, self.eval_limit(stage)) if limit_override is None else limit_override
                    if len(loaders) > 1:  # each loader's values kept apart: name/dataloader_idx_N
                        with self.log_into(store, suffix=f"/dataloader_idx_{idx}"):
                            self.eval_loader(stage, method, loader, idx, n)
                    else:
                        self.eval_loader(stage, method, loader, None, n)
                self.emit(f"on_{hook}_epoch_end")
            results = self.end_evaluation(stage, store, len(loaders))
            self.emit(f"on_{hook}_end")
            self.emit(f"on_{hook}_model_train")
            return results

    def end_evaluation(self, stage: str, store: MetricStore, count: int) -> list[dict[str, torch.Tensor]]:
        tr = self.trainer
        values = store.epoch_values()
        results = _split_by_loader(values, count)
        if stage != "sanity_check":
            self.epoch_metrics.update(values)
            logged = store.logger_keys(values)
            if logged and self.stage == "fit":
                self.log_to_loggers({**logged, "epoch": tr.fit_state.epoch})
            elif logged:
                self.log_to_loggers(logged)
        self.emit("on_eval_end", stage)
        return results

    def eval_loader(self, stage: str, method: Any, loader: Any, idx: int | None, n: float) -> None:
        prepared = self.prepared_module
        assert prepared is not None
        if n <= 0:
            return
        call = self.trainer.rig.strategy.step_caller(prepared, method)
        with_idx = idx is not None and _takes_loader_index(method)
        hook = _HOOK_STAGE[stage]
        start, end = self.hooks(f"on_{hook}_batch_start"), self.hooks(f"on_{hook}_batch_end")
        eval_end, extra = self.hooks("on_eval_batch_end"), () if idx is None else (idx,)
        for batch_idx, batch in enumerate(self.transferred(loader, idx or 0)):
            for hook_fn in start:
                hook_fn(batch, batch_idx, *extra)
            output = call(batch, batch_idx, idx) if with_idx else call(batch, batch_idx)
            for hook_fn in end:
                hook_fn(output, batch, batch_idx, *extra)
            for hook_fn in eval_end:
                hook_fn(stage, output, batch, batch_idx)
            if batch_idx + 1 >= n:
                break

    def predict(self) -> list[Any] | None:
        """Predictions per batch, in dataset order, gathered from every process (None when
        ``trainer.predict(return_predictions=False)``: each process keeps its own, for a
        :class:`~torchrig.BasePredictionWriter` to write, and nothing is gathered).

        On ``W`` processes each returned batch holds the ``W`` per-process batches of one step,
        interleaved back into dataset order (:meth:`torchrig.Rig.gather_for_metrics`).
        """
        tr = self.trainer
        prepared = self.prepared_module
        assert prepared is not None
        loaders = self.eval_loaders["predict"]
        self.emit("on_predict_model_eval")
        self.emit("on_predict_start")
        self.emit("on_eval_start", "predict")
        self.emit("on_predict_epoch_start")
        start, end = self.hooks("on_predict_batch_start"), self.hooks("on_predict_batch_end")
        eval_end = self.hooks("on_eval_batch_end")
        results: list[Any] = []
        keep, track = self.return_predictions, self.track_batch_indices()
        with self.eval_context():
            for idx, loader in enumerate(loaders):
                n = num_batches(loader, tr.limit_predict_batches)
                outputs: list[Any] = []
                predict_step = tr.rig.strategy.step_caller(prepared, self.require_module().predict_step)
                indices = batch_indices(loader) if track else None
                self.predict_dataloader_idx = idx
                extra = (idx,) if len(loaders) > 1 else ()
                for batch_idx, batch in enumerate(self.transferred(loader, idx)):
                    if batch_idx >= n:
                        break
                    for hook in start:
                        hook(batch, batch_idx, *extra)
                    out = predict_step(batch, batch_idx)
                    if indices is not None:
                        self.predict_batch_indices = indices[batch_idx] if batch_idx < len(indices) else []
                    for hook in end:
                        hook(out, batch, batch_idx, *extra)
                    for hook in eval_end:
                        hook("predict", out, batch, batch_idx)
                    if keep:  # in dataset order, each sample once (the sampler's padding dropped)
                        outputs.append(tr.rig.gather_for_metrics(out))
                results.append(outputs)
        self.emit("on_predict_epoch_end")
        self.emit("on_predict_end")
        self.emit("on_eval_end", "predict")
        if not keep:
            return None
        return results[0] if len(results) == 1 else results


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


def batch_indices(loader: Any) -> list[list[int]] | None:
    """The dataset indices of each batch this process's ``loader`` yields (for prediction
    writers), read from its batch sampler; None for a loader without one (an iterable dataset)."""
    inner = getattr(loader, "loader", loader)
    sampler = getattr(inner, "batch_sampler", None)
    if sampler is None:
        return None
    epoch = getattr(loader, "epoch", None)  # the epoch the next iter() runs: the same order
    if epoch is not None and hasattr(inner.sampler, "set_epoch"):
        inner.sampler.set_epoch(epoch + 1)
    return [list(batch) for batch in sampler]


#: Which Lightning hooks (``on_<this>_start``...) an evaluation stage calls.
_HOOK_STAGE = {"sanity_check": "validation", "validate": "validation", "test": "test", "predict": "predict"}


def stop_at_step(signum: int) -> NoReturn:
    """End a fit that a stop signal (agreed by every rank) asked to stop, now that it is at an
    optimizer step, the state a checkpoint saves exactly: the Trainer saves ``last``, then exits
    (see ``stages._on_error``)."""
    raise Preempted(signum)


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


def _takes_loader_index(method: Any) -> bool:
    """Whether a ``*_step`` accepts ``dataloader_idx`` (passed only with several loaders)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_POSITIONAL for p in params) or len(params) >= 3


def _split_by_loader(values: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    if count <= 1:
        return [dict(values)]
    out: list[dict[str, torch.Tensor]] = []
    for idx in range(count):
        suffix = f"/dataloader_idx_{idx}"
        out.append({k: v for k, v in values.items() if k.endswith(suffix) or "/dataloader_idx_" not in k})
    return out


def metrics_as_floats(results: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    return [to_floats(dict(r)) for r in results]
