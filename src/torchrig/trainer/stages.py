"""The Trainer's entry points (fit, validate/test/predict) as each process runs them: launching,
set-up, the loop, errors and teardown. What a fit's checkpoint holds and how a fit resumes from
one is :mod:`torchrig.trainer.resume`."""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.utils.data import DataLoader

from torchrig import speedups
from torchrig.checkpoint.remote import CheckpointURL
from torchrig.clusters import CLUSTER_ENVIRONMENTS
from torchrig.data import RigDataLoader
from torchrig.diagnostics import warn_at_caller
from torchrig.nested import apply_to_tensors
from torchrig.preemption import Preempted, SignalWatch, restart_count
from torchrig.strategies.sync_batchnorm import convert_sync_batchnorm
from torchrig.trainer import debugging, eval_loops, loops, settings
from torchrig.trainer.callbacks import Callback, merge_callbacks, overrides, unknown_hooks
from torchrig.trainer.datamodule import DataModule
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.optim_config import parse_optimizers
from torchrig.trainer.resume import align_batch_index, auto_resume, resolve_path, resume
from torchrig.trainer.summary import summary_table
from torchrig.wrappers import RigModule

if TYPE_CHECKING:
    from torchrig.rig import Rig
    from torchrig.trainer.trainer import Trainer

_LOADER_METHODS = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def run_fit_stage(
    tr: Trainer,
    module: TrainingModule,
    train: Any,
    val: Any,
    datamodule: DataModule | None,
    ckpt_path: str | os.PathLike[str] | None,
) -> None:
    module = begin(tr, module, "fit")
    tr.run.datamodule = datamodule  # trainer.datamodule, from the setup hooks on (as Lightning's)
    try:
        setup(tr, module, datamodule, "fit")
        prepare_module(tr, module)
        tr.run.train_loader = None
        # Asked for after configure_optimizers (Lightning's order), or inside it when it reads
        # trainer.estimated_stepping_batches (sizing a OneCycle or warm-up schedule).
        tr.run.pending_train = lambda: _train_loader(tr, module, datamodule, train)
        tr.run.train_given = train is not None
        configure_optimizers(tr, module)
        tr.run.ensure_train_loader()
        given_val = val
        val = _loaders_of(module, datamodule, given_val, "val_dataloader")
        tr.run.reload_sources = (
            lambda: _train_loader(tr, module, datamodule, train),
            lambda: _prepare_loaders(
                tr, _loaders_of(module, datamodule, given_val, "val_dataloader"), "val_dataloaders"
            ),
        )
        tr.run.check_training_batches()
        tr.run.eval_loaders["validate"] = _prepare_loaders(tr, val, "val_dataloaders")
        tr.fit_state, tr.should_stop, tr.run.resumed, tr.run.resumed_from = loops.FitState(), False, False, None
        tr.run.train_metrics.reset()
        tr.run.epoch_metrics.clear()
        if ckpt_path is None and tr.auto_resume and restart_count() > 0:
            auto_resume(tr)
        elif ckpt_path is not None:
            resume(tr, ckpt_path)
        hparams = getattr(module, "hparams", None)
        if hparams and tr.enable_autolog_hparams:
            for lg in tr.loggers:
                lg.log_hyperparams(dict(hparams))
        depth = settings.summary_depth(tr)
        if depth and tr.is_global_zero:  # after a resume's message, as prepared for the run
            tr.rig.print(summary_table(module, tr.rig.precision.name, depth), end="")
        tr.run.emit("on_fit_start")
        # Installed until the fit ends, or until the save of a stop is done (in _on_error).
        tr.run.signals = SignalWatch(tr.rig.strategy, tr.stop_signals).install()
        first_step = tr.global_step
        with debugging.anomaly_detection(tr):
            tr.run.fit()
            found = tr.run.signals.settle()  # a signal during the fit's last step still stops it
            if found:
                loops.stop_at_step(found)
        tr.run.signals.restore()
        _warn_if_steps_were_not_logged(tr, first_step)
        tr.run.emit("on_fit_end")
        _finalize_loggers(tr, "success")
    except BaseException as exc:
        _on_error(tr, exc)
    finally:
        tr.run.signals.restore()
        teardown(tr, module, datamodule, "fit")


def run_eval_stage(
    tr: Trainer,
    stage: str,
    module: TrainingModule | None,
    loaders: Any,
    datamodule: DataModule | None,
    ckpt_path: str | os.PathLike[str] | None,
) -> Any:
    if module is None:
        module = tr.module
    if module is None:
        raise ValueError(f"{stage}() needs a module: pass one, or call fit() first")
    module = begin(tr, module, stage)
    tr.run.datamodule = datamodule
    try:
        setup(tr, module, datamodule, stage)
        prepared = prepare_module(tr, module)
        tr.run.eval_given = loaders is not None
        loaders = _loaders_of(module, datamodule, loaders, _LOADER_METHODS[stage])
        if loaders is None:
            raise ValueError(
                f"{stage}() needs data: pass dataloaders=, a datamodule= with {_LOADER_METHODS[stage]}(), "
                f"or define {_LOADER_METHODS[stage]}() on {type(module).__name__}"
            )
        tr.run.eval_loaders[stage] = _prepare_loaders(tr, loaders, "dataloaders")
        if ckpt_path is not None:
            path = resolve_path(tr, ckpt_path)
            if path is not None:
                tr.rig.load(path, {"module": prepared})
        if stage == "predict":
            result: Any = tr.run.predict()
        else:
            result = eval_loops.metrics_as_floats(tr.run.evaluate(stage))
        _finalize_loggers(tr, "success")
        return result
    except BaseException as exc:
        _on_error(tr, exc)
    finally:
        teardown(tr, module, datamodule, stage)


# -- every process ---------------------------------------------------------------------------
def launch(tr: Trainer, body: Callable[..., Any], module: TrainingModule | None, *args: Any) -> Any:
    """Run ``body(tr, *args)`` in every process of the Trainer's Rig; its result.

    ``module`` is the module the run works on (None: the Trainer's current one). When the
    strategy starts processes (``ddp_spawn``), rank 0 sends back its result, the module's
    weights, where the fit is, the callbacks' state and the epoch metrics, and they are loaded
    here, into ``module``, the Trainer and its callbacks.
    """
    spawned = tr.rig.strategy.needs_launch
    tr.run.refresh_hooks()  # no bound methods travel to started processes
    out = tr.rig.launch(_worker, tr, body, spawned, *args)
    if not (spawned and isinstance(out, _Returned)):
        return out
    module = module if module is not None else tr.module
    if module is not None and out.weights is not None:
        module.load_state_dict(out.weights)
    tr.fit_state.load_state_dict(out.fit_state)
    # The callbacks that ran were copies (best_model_path, early stopping's count...).
    for cb, state in zip(tr.callbacks, out.callbacks, strict=True):
        cb.load_state_dict(state)
    tr.run.epoch_metrics = dict(out.epoch_metrics)  # callback_metrics: the epoch means
    return out.result


@dataclass
class _Returned:
    """What rank 0 of started processes sends back: the result, the weights, where the fit is,
    each callback's state (in the Trainer's order) and the epoch metrics."""

    result: Any
    weights: dict[str, torch.Tensor] | None
    fit_state: dict[str, Any]
    callbacks: list[dict[str, Any]]
    epoch_metrics: dict[str, torch.Tensor]


def _worker(rig: Rig, tr: Trainer, body: Callable[..., Any], spawned: bool, *args: Any) -> Any:
    result = body(tr, *args)
    if not spawned:
        return result
    # The started processes end with this call: tensors go back as CPU copies (the launcher
    # pickles the return value into a file), not as views of memory that is about to go away.
    module = tr.module

    def cpu(value: Any) -> Any:
        return apply_to_tensors(value, lambda t: t.detach().cpu())

    return _Returned(
        result=cpu(result),
        weights=cpu(module.state_dict()) if module is not None else None,
        fit_state=tr.fit_state.state_dict(),
        callbacks=[cpu(cb.state_dict()) for cb in tr.callbacks],
        epoch_metrics=cpu(dict(tr.run.epoch_metrics)),
    )


# -- set-up and teardown ---------------------------------------------------------------------
def begin(tr: Trainer, given: TrainingModule, stage: str) -> TrainingModule:
    """Start a run of ``given`` (a ``TrainingModule``, or ``torch.compile`` of one: the run's
    module is then the one inside, prepared compiled the same way); the run's module."""
    module, compiler = speedups.unwrap_compiled(given)
    if not isinstance(module, TrainingModule):
        raise TypeError(
            f"Trainer.{stage}() takes a torchrig.TrainingModule, got {type(module).__name__}; "
            "subclass torchrig.TrainingModule (or use torchrig.Rig with a plain nn.Module)"
        )
    tr.run.compiled = given if compiler is not None else None
    tr.module, tr.run.stage, tr.interrupted = module, stage, False
    tr.run.epoch_metrics.clear()  # callback_metrics and logged_metrics start empty, as Lightning's
    tr.run.logged_all.clear()
    tr.run.shows_training = stage == "fit"
    tr.run.refresh_hooks()
    module._trainer = tr
    if overrides(module, TrainingModule, "configure_callbacks") or tr.run.given_callbacks is not None:
        if tr.run.given_callbacks is None:  # the Trainer's own, kept apart from each module's
            tr.run.given_callbacks = list(tr.callbacks)
        tr.callbacks = merge_callbacks(tr.run.given_callbacks, module.configure_callbacks())
    for owner, base in [(module, TrainingModule), *((cb, Callback) for cb in tr.callbacks)]:
        for line in unknown_hooks(owner, base):
            warnings.warn(line, stacklevel=4)
    if tr.seed is not None:
        tr.rig.seed_everything(tr.seed)
    if tr.deterministic is not None:
        if tr.deterministic and tr.rig.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(bool(tr.deterministic), warn_only=tr.deterministic == "warn")
    if tr.benchmark is not None:
        torch.backends.cudnn.benchmark = tr.benchmark
    elif tr.deterministic is True:
        torch.backends.cudnn.benchmark = False  # autotuning picks algorithms by timing: not deterministic
    return module


def setup(tr: Trainer, module: TrainingModule, datamodule: DataModule | None, stage: str) -> None:
    """``prepare_data`` (local rank 0 of each machine; the others wait), then ``setup(stage)``
    (the datamodule's, the callbacks', the module's), then ``configure_model`` inside
    ``rig.init_module()``, as Lightning orders them."""
    owners = [(datamodule, DataModule), (module, TrainingModule)]
    preparing = [x.prepare_data for x, base in owners if x is not None and overrides(x, base, "prepare_data")]
    if preparing:
        if tr.rig.local_rank == 0:
            for prepare in preparing:
                prepare()
        tr.rig.barrier("prepare_data")
    if datamodule is not None:
        datamodule.setup(stage)
    tr.run.emit("setup", stage)
    if overrides(module, TrainingModule, "configure_model"):
        with tr.rig.init_module():
            module.configure_model()


def teardown(tr: Trainer, module: TrainingModule, datamodule: DataModule | None, stage: str) -> None:
    for loader in [tr.run.train_loader, *(one for kind in tr.run.eval_loaders.values() for one in kind)]:
        if isinstance(loader, RigDataLoader):
            loader.end_workers()  # a stage stopped mid-epoch: its workers end with it, not at a later GC
    tr.run.emit("teardown", stage)
    if datamodule is not None:
        datamodule.teardown(stage)
    tr.run.stage = None


def _loaders_of(module: TrainingModule, datamodule: DataModule | None, given: Any, method: str) -> Any:
    """The loaders a stage uses: those given; else the datamodule's ``method()``; else the
    module's own ``method()`` (``train_dataloader``...), when it defines one, as in Lightning."""
    if given is not None:
        return given
    if datamodule is not None:
        return getattr(datamodule, method)()
    own = getattr(module, method, None)
    return own() if callable(own) else None


def _on_error(tr: Trainer, exc: BaseException) -> NoReturn:
    """Tell the callbacks, close the loggers, re-raise. A fit stopped by a stop signal at an
    optimizer step (:class:`~torchrig.Preempted`, agreed by every rank) first saves ``last``
    there on every rank, requeues a SLURM job for ``requeue_signal``, then raises
    ``KeyboardInterrupt`` for SIGINT and :class:`~torchrig.Preempted` (exit status 128 + signal,
    0 when requeued) for the others."""
    stop = exc if isinstance(exc, Preempted) else None
    interrupted = stop is not None or isinstance(exc, KeyboardInterrupt)
    saved: Path | CheckpointURL | None = None
    try:
        if interrupted:
            tr.interrupted = tr.should_stop = True
        if stop is not None and tr.checkpoint_callback is not None:  # not a second Ctrl-C mid-step
            saved = tr.checkpoint_callback.save_interrupted(tr)
        if stop is not None:
            requeued = stop.signum == tr.requeue_signal and _requeue(tr)
            exc = stop = Preempted(stop.signum, requeued=requeued, saved=None if saved is None else str(saved))
        if tr.module is not None:
            tr.run.emit("on_exception", exc)
    finally:
        _finalize_loggers(tr, "interrupted" if interrupted else "failed")
        if interrupted:
            name = stop.signum.name if stop is not None else "KeyboardInterrupt"
            where = f"saved step {tr.global_step} as {saved}" if saved is not None else "saved nothing now"
            then = "; requeued the job" if stop is not None and stop.requeued else ""
            tr.rig.print(f"torchrig: {name}: stopped the run; {where}{then}")
    if stop is not None and stop.signum == signal.SIGINT:
        raise KeyboardInterrupt from None
    raise exc


def _requeue(tr: Trainer) -> bool:
    """Rank 0 requeues the scheduler job (``scontrol requeue`` under SLURM; the checkpoint is
    committed by now); every rank learns whether it worked."""
    why = CLUSTER_ENVIRONMENTS.requeue() if tr.is_global_zero else None
    if why is not None:
        print(f"torchrig: could not requeue the job: {why}", file=sys.stderr)
    return bool(tr.rig.broadcast(why is None))


def _finalize_loggers(tr: Trainer, status: str) -> None:
    for lg in tr.loggers:
        lg.finalize(status)


def _warn_if_steps_were_not_logged(tr: Trainer, first_step: int) -> None:
    """Warn when values were logged per step but the fit ended before the first step that sends
    them to the loggers (every ``log_every_n_steps`` optimizer steps)."""
    steps, every = tr.global_step - first_step, tr.log_every_n_steps
    if not tr.loggers or not tr.is_global_zero or steps == 0 or tr.global_step // every != first_step // every:
        return
    logged = sorted(tr.run.train_metrics.step_values(for_logger=True))
    if logged:
        warn_at_caller(
            f"this fit ran {steps} optimizer steps, fewer than Trainer(log_every_n_steps={every}): the values "
            f"logged per step ({', '.join(logged)}) never reached the loggers; set log_every_n_steps={steps} or "
            "lower, or log with on_epoch=True"
        )


# -- preparing ----------------------------------------------------------------------------------
def prepare_module(tr: Trainer, module: TrainingModule) -> RigModule:
    if tr.run.prepared_module is None or tr.run.prepared_module.module is not module:
        if tr.sync_batchnorm and tr.rig.world_size > 1:
            convert_sync_batchnorm(module, tr.rig.strategy, tr.rig.device.type)
        given = module if tr.run.compiled is None else tr.run.compiled  # a compiled module: compiled again
        tr.run.prepared_module = tr.rig.prepare(given)
    return tr.run.prepared_module


def configure_optimizers(tr: Trainer, module: TrainingModule) -> None:
    """The fit's optimizers and schedulers from ``configure_optimizers()``, prepared."""
    custom = overrides(module, TrainingModule, "lr_scheduler_step")
    optimizers, tr.lr_scheduler_configs = parse_optimizers(module.configure_optimizers(), custom)
    out = tr.rig.prepare(*optimizers)
    tr.optimizers = list(out) if isinstance(out, tuple) else [out]


def remake_fit_setup(tr: Trainer, *, loaders: bool, optimizers: bool) -> None:
    """At the fit's start (``on_fit_start``), after a tuner changed what the loaders or the
    optimizers are made from (a batch size, a learning rate): with ``loaders``, ask the
    datamodule (or module) for the fit's loaders again; with ``optimizers``,
    ``configure_optimizers()`` again; so the fit runs as one given the new values from the start.

    The new loaders take the old ones' place and shuffle seed (no draw from torch's RNG), so a
    resumed fit continues at the checkpoint's position, converted to the new batch size. On
    resume keep ``optimizers=False``: their state, loaded from the checkpoint, is the fit's.
    """
    run = tr.run
    if loaders:
        old_train, old_val = run.train_loader, run.eval_loaders["validate"]
        with torch.random.fork_rng(devices=[]):  # the seeds drawn here are replaced by the old ones
            run.reload_loaders()
        pairs = [(old_train, run.train_loader), *zip(old_val, run.eval_loaders["validate"], strict=False)]
        for old, new in pairs:
            if isinstance(old, RigDataLoader) and isinstance(new, RigDataLoader) and old is not new:
                new.load_state_dict(old.state_dict())
        if run.resumed:
            align_batch_index(tr)
        run.check_training_batches()
    if optimizers:
        configure_optimizers(tr, run.require_module())


def remake_eval_loaders(tr: Trainer, stage: str) -> None:
    """At the start of a validate/test/predict run (``on_test_start``...), after a tuner changed
    the batch size: ask the datamodule (or module) for the stage's loaders again; the loop runs
    the new ones (replaced in place in the run's list)."""
    module = tr.run.require_module()
    loaders = _loaders_of(module, tr.run.datamodule, None, _LOADER_METHODS[stage])
    tr.run.eval_loaders[stage][:] = _prepare_loaders(tr, loaders, "dataloaders")


def _train_loader(tr: Trainer, module: TrainingModule, datamodule: DataModule | None, given: Any) -> Any:
    """The fit's training loader, prepared: the one given, else the datamodule's or the module's
    ``train_dataloader()``."""
    train = _loaders_of(module, datamodule, given, "train_dataloader")
    if train is None:
        raise ValueError(
            "fit() needs training data: pass train_dataloaders=, a datamodule= with train_dataloader(), "
            f"or define train_dataloader() on {type(module).__name__}"
        )
    return _moves_batches(
        tr, [_prepare_loader(tr, debugging.train_loader(tr, train), "train_dataloaders", several=False)]
    )[0]


def _prepare_loader(tr: Trainer, loader: Any, what: str, *, several: bool = True) -> Any:
    """``loader`` prepared (once per run); ``several``: ``what`` also takes a list of loaders."""
    if isinstance(loader, RigDataLoader):
        return loader
    if not isinstance(loader, DataLoader):
        got = type(loader).__name__
        if isinstance(loader, (list, tuple)):
            got = f"a {got} holding {', '.join(sorted({type(item).__name__ for item in loader})) or 'nothing'}"
        takes = "a torch.utils.data.DataLoader (or a list of them)" if several else "one torch.utils.data.DataLoader"
        hint = "" if several else " (a fit trains on one loader: join datasets with torch.utils.data.ConcatDataset)"
        raise TypeError(f"{what} must be {takes}; got {got}{hint}")
    cached = tr.run.prepared_loaders.get(id(loader))
    if cached is not None and cached[0] is loader:
        return cached[1]
    prepared = tr.rig.prepare(loader, use_distributed_sampler=tr.use_distributed_sampler)
    tr.run.prepared_loaders[id(loader)] = (loader, prepared)
    return prepared


def _moves_batches(tr: Trainer, loaders: list[Any]) -> list[Any]:
    """``loaders``, each told whether it moves its batches to the device itself: not when the
    module does in its batch-transfer hooks (:meth:`~torchrig.trainer.loops.Run.transferred`)."""
    own = tr.run.transfer_hooks() is not None
    for loader in loaders:
        if isinstance(loader, RigDataLoader):
            loader.move_batches = not own
    return loaders


def _prepare_loaders(tr: Trainer, loaders: Any, what: str) -> list[Any]:
    if loaders is None:
        return []
    items = list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
    return _moves_batches(tr, [_prepare_loader(tr, d, what) for d in items])
