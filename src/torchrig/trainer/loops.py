"""The loops a Trainer runs: fit (epochs of batches, with validation); its training step is
:mod:`torchrig.trainer.step_runner`, evaluation and predict :mod:`torchrig.trainer.eval_loops`.

Everything that touches devices, precision or processes goes through the Trainer's ``Rig``.
The hot path (one training batch) does no host-device synchronisation: losses and logged
values stay tensors on the device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from torchrig.data import length_of
from torchrig.preemption import Preempted
from torchrig.trainer.eval_loops import EvalLoops
from torchrig.trainer.profiler import DATA, VALIDATION
from torchrig.trainer.step_runner import StepRunner, batch_outputs


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


class Run(StepRunner, EvalLoops):
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
                self.epoch_metrics.clear()  # what the sanity check logged is not the fit's
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
        sink = self.sink  # the training step's (run_batches)
        for batch in self.transferred(batches, 0):
            is_last = batch_idx + 1 >= n or (ends is not None and ends.at_last_batch)
            self.is_last_batch = is_last
            sink.batch = batch
            skip = False
            for hook in batch_start:
                skip = hook(batch, batch_idx) == -1 or skip
            if skip:  # on_train_batch_start returned -1: the rest of the epoch is skipped (as Lightning)
                break
            output = one_batch(batch, batch_idx, is_last)
            if batch_end or sparse:
                output = batch_outputs(output)
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

    def validate_in_fit(self) -> None:
        self.evaluate("validate")
        self.trainer.fit_state.val_pending = False

    def end_train_epoch(self) -> None:
        tr = self.trainer
        # The epoch's means, as the hooks read them in callback_metrics (as in Lightning), then
        # again with what they logged themselves.
        self.reduce_train_epoch()
        with self.log_into(self.train_metrics):  # the callbacks that do not read the epoch's metrics, the module
            for hook in self.hooks("on_train_epoch_end", monitoring=False):
                hook()
        epoch_values = self.reduce_train_epoch()
        logged = self.train_metrics.logger_keys(epoch_values)
        if logged:
            self.log_to_loggers({**logged, "epoch": tr.fit_state.epoch})
        if self.require_module().automatic_optimization:  # manual optimization steps its own schedulers
            self.step_schedulers("epoch", tr.fit_state.epoch + 1)
        tr.fit_state.epoch_finished = True
        for hook in self.hooks("on_train_epoch_end", monitoring=True):  # checkpointing, early stopping
            hook()

    def reduce_train_epoch(self) -> dict[str, Any]:
        """The training epoch's means (:meth:`MetricStore.epoch_values`), now in ``callback_metrics``."""
        store = self.train_metrics
        values = store.epoch_values()
        self.epoch_metrics.update(store.callback_values(values))
        store.reduced = True
        return values


def stop_at_step(signum: int) -> NoReturn:
    """End a fit that a stop signal (agreed by every rank) asked to stop, now that it is at an
    optimizer step, the state a checkpoint saves exactly: the Trainer saves ``last``, then exits
    (see ``stages._on_error``)."""
    raise Preempted(signum)
