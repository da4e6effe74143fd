"""``Trainer``: loops, hooks, logging and checkpoints over a :class:`~torchrig.Rig`."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch.utils.data import DataLoader

from torchrig import arguments
from torchrig.checkpoint.background import SaveHandle
from torchrig.checkpoint.remote import CheckpointURL, as_url, local_path
from torchrig.preemption import SignalsLike, resolve_requeue_signal, resolve_signals
from torchrig.rig import Rig
from torchrig.trainer import debugging, loops, resume, settings, stages
from torchrig.trainer.callbacks import Callback
from torchrig.trainer.checkpointing import ModelCheckpoint
from torchrig.trainer.datamodule import DataModule
from torchrig.trainer.logger_base import Logger
from torchrig.trainer.metrics import unforked_name
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.optim_config import SchedulerConfig
from torchrig.trainer.profiler import Profiler, resolve_profiler
from torchrig.trainer.run import num_batches

Limit = int | float


class Trainer:
    """Fits, validates, tests and predicts with a :class:`TrainingModule`, on any hardware.

    Args:
        accelerator: hardware, as for :class:`~torchrig.Rig` (``"auto"``, ``"cpu"``, ``"cuda"``, a registered name).
        devices: devices (processes) per machine, as for :class:`~torchrig.Rig`.
        strategy: process layout (``"auto"``, ``"ddp"``, ``"ddp_spawn"``, ``"fsdp"``...).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``...
        num_nodes: machines taking part.
        timeout: how long a collective waits for the other ranks, as for :class:`~torchrig.Rig`.
        compile: ``None``, ``True`` (the whole model), ``"regional"`` (each repeated block) or a dict of
            ``torch.compile`` arguments, as for :class:`~torchrig.Rig` (docs/speed.md).
        activation_checkpointing: ``None``, a set of block classes, ``"full"``, ``"selective"`` or
            ``("selective", n)``, as for :class:`~torchrig.Rig` (docs/speed.md).
        max_epochs: stop after this many epochs (``-1``: no limit; default 1000 unless ``max_steps`` is set).
        max_steps: stop after this many optimizer steps (``-1``: no limit).
        max_time: stop after this long: seconds, a ``timedelta``, or ``"DD:HH:MM:SS"``.
        accumulate_grad_batches: step the optimizer every this many batches (and at an epoch's end).
        gradient_clip_val: clip gradients to this norm (or value); None: no clipping.
        gradient_clip_algorithm: ``"norm"`` (total norm) or ``"value"`` (each element).
        val_check_interval: validate every this many training batches (int) or fraction of an epoch (float).
        check_val_every_n_epoch: validate only in every n-th epoch.
        limit_train_batches: batches per training epoch: a count (int) or a fraction (float).
        limit_val_batches: the same for each validation run.
        limit_test_batches: the same for ``test``.
        limit_predict_batches: the same for ``predict``.
        num_sanity_val_steps: validation batches run before training to catch bugs early (-1: all).
        callbacks: :class:`Callback` objects, called in order.
        logger: a :class:`Logger`, a list of them, True (a ``CSVLogger`` under ``default_root_dir``) or False.
        log_every_n_steps: send ``on_step`` values to the logger every this many optimizer steps (a fit
            with fewer steps in all warns).
        default_root_dir: where logs and checkpoints go (default: the working directory); each run's
            checkpoints go into its logger's ``version_N/checkpoints`` (without a logger, ``checkpoints``).
        enable_progress_bar: add the rich progress bar.
        enable_checkpointing: add a :class:`ModelCheckpoint` unless one is given: it saves at epoch ends, at
            most once a minute, and at the end of the fit, with the ``last`` link (``ckpt_path="last"``).
        deterministic: ``torch.use_deterministic_algorithms`` (True, False, or ``"warn"``); None leaves it.
        seed: seed Python, NumPy and torch when the Trainer is built (so a module built after it
            starts the same in every run) and in every process when each run starts.
        stop_signals: signals that stop a fit at the next optimizer step on every rank, save ``last``
            there and exit with status 128 + the signal's number (:class:`~torchrig.Preempted`; SIGINT
            raises ``KeyboardInterrupt``). ``"auto"``: SIGTERM and SIGINT, and SIGUSR1 under SLURM;
            a list of names (``["SIGTERM", "SIGUSR2"]``); ``None``: none. See docs/distributed.md,
            "Preemption and restarts".
        requeue_signal: under SLURM, after saving for this signal, rank 0 runs ``scontrol requeue``
            and the processes exit with status 0 (``"auto"``: SIGUSR1 under SLURM; ``None``: never).
        auto_resume: when a launcher restarted the job (``TORCHELASTIC_RESTART_COUNT`` or
            ``SLURM_RESTART_COUNT`` above 0), ``fit()`` without ``ckpt_path`` resumes from the newest
            ``last`` (as ``ckpt_path="last"``) and says so; False starts such a fit from scratch.
        fast_dev_run: ``True`` or ``N``: run 1 (or N) batches of each loop (train, validation, test,
            predict) in one epoch, without the sanity check, loggers or checkpoints: nothing is written.
        overfit_batches: train every epoch on the same first batches: a count (int) or a fraction of
            the epoch (float); the training loader is not shuffled and validation uses as many batches.
        detect_anomaly: run the fit under ``torch.autograd.set_detect_anomaly(True)`` (slow; a backward
            that makes NaN raises and names the forward operation that led to it).
        profiler: where the fit's time goes: None (nothing, no cost), ``"simple"`` (a table of each
            phase's share of the step and the slowest hooks, when the fit ends), ``"pytorch"``
            (``torch.profiler`` traces over a few steps, in the run directory) or a
            :class:`~torchrig.trainer.profiler.Profiler` object such as ``PyTorchProfiler(active=5)``.
        enable_model_summary: print a table of the module's top-level layers (types, trainable
            and frozen parameters, size in the run's precision) when a fit starts, on global rank zero.
        min_epochs: the fit runs at least this many epochs: a stop asked for earlier (``should_stop``
            from :class:`EarlyStopping`, ``max_time`` or a callback) is held until then. None: no minimum.
        min_steps: the same in optimizer steps.
        benchmark: ``torch.backends.cudnn.benchmark`` for the run (cuDNN tries the algorithms for each
            input shape and keeps the fastest). None: as it is set, or False when ``deterministic=True``.
        inference_mode: run validation, test and predict under ``torch.inference_mode()`` (True,
            the default) or ``torch.no_grad()`` (False: tensors made there may later take part in
            autograd). Under FSDP and model parallel strategies always ``no_grad``.
        sync_batchnorm: with several processes, turn the module's BatchNorm layers into SyncBatchNorm,
            so their batch statistics are those of the global batch (what one process with the
            whole batch computes), see :func:`torchrig.strategies.convert_sync_batchnorm`.
        use_distributed_sampler: with several processes, give each loader a sampler that splits it
            across them (and resumes exactly); False keeps the loaders' own samplers and datasets,
            for loaders that already give each process its share (see :meth:`torchrig.Rig.setup_dataloader`).
        reload_dataloaders_every_n_epochs: ask the datamodule's (or module's) ``train_dataloader()``
            and ``val_dataloader()`` again every n epochs (curriculum learning; 0: never); a resumed
            fit asks for them as the uninterrupted fit did, and resumes exactly.
        enable_autolog_hparams: send the module's ``hparams`` (``save_hyperparameters``) to the
            loggers when a fit starts.

    Example:
        >>> # trainer = Trainer(accelerator="auto", devices=1, max_epochs=3)
        >>> # trainer.fit(MyModule(), train_loader, val_loader)
        >>> # trainer.test(dataloaders=test_loader)
    """

    def __init__(
        self,
        *,
        accelerator: Any = None,
        devices: Any = None,
        strategy: Any = None,
        precision: Any = None,
        num_nodes: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        compile: bool | str | dict[str, Any] | None = None,
        activation_checkpointing: Any = None,
        max_epochs: int | None = None,
        max_steps: int = -1,
        max_time: float | str | datetime.timedelta | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int = 1,
        limit_train_batches: Limit = 1.0,
        limit_val_batches: Limit = 1.0,
        limit_test_batches: Limit = 1.0,
        limit_predict_batches: Limit = 1.0,
        num_sanity_val_steps: int = 2,
        callbacks: Callback | Iterable[Callback] | None = None,
        logger: Logger | Iterable[Logger] | bool = True,
        log_every_n_steps: int = 50,
        default_root_dir: str | os.PathLike[str] | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        deterministic: bool | str | None = None,
        seed: int | None = None,
        stop_signals: SignalsLike = "auto",
        requeue_signal: str | int | None = "auto",
        auto_resume: bool = True,
        fast_dev_run: bool | int = False,
        overfit_batches: int | float = 0.0,
        detect_anomaly: bool = False,
        profiler: Profiler | str | None = None,
        enable_model_summary: bool = True,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        sync_batchnorm: bool = False,
        use_distributed_sampler: bool = True,
        reload_dataloaders_every_n_epochs: int = 0,
        enable_autolog_hparams: bool = True,
        **lightning_only: Any,
    ) -> None:
        settings.refuse_lightning_only(lightning_only)
        self.max_steps = arguments.int_in_range("max_steps", max_steps, -1)
        default_epochs = -1 if max_steps != -1 else 1000
        self.max_epochs = default_epochs if max_epochs is None else arguments.int_in_range("max_epochs", max_epochs, -1)
        self.max_time = settings.parse_time(max_time)
        self.accumulate_grad_batches = arguments.int_in_range("accumulate_grad_batches", accumulate_grad_batches, 1)
        clip = None if gradient_clip_val is None else arguments.clip_threshold("gradient_clip_val", gradient_clip_val)
        self.gradient_clip_val = clip or None  # 0 clips nothing
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; use 'norm' or 'value'")
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = settings.batch_limit("val_check_interval", val_check_interval, allow_zero=False)
        self.check_val_every_n_epoch = arguments.int_in_range("check_val_every_n_epoch", check_val_every_n_epoch, 1)
        self.limit_train_batches = settings.batch_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = settings.batch_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = settings.batch_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = settings.batch_limit("limit_predict_batches", limit_predict_batches)
        self.num_sanity_val_steps = arguments.int_in_range("num_sanity_val_steps", num_sanity_val_steps, -1)
        self.log_every_n_steps = arguments.int_in_range("log_every_n_steps", log_every_n_steps, 1)
        if deterministic not in (None, True, False, "warn"):
            raise ValueError(f"deterministic={deterministic!r}; use True, False, 'warn' or None")
        self.deterministic = deterministic
        self.seed = None if seed is None else arguments.seed("seed", seed)
        self.requeue_signal = resolve_requeue_signal(requeue_signal)
        signals = resolve_signals(stop_signals)
        requeue = self.requeue_signal
        self.stop_signals = signals + ((requeue,) if requeue is not None and requeue not in signals else ())
        if not isinstance(auto_resume, bool):
            raise ValueError(f"auto_resume={auto_resume!r} must be True or False")
        self.auto_resume = auto_resume
        self.profiler = resolve_profiler(profiler)
        if not isinstance(enable_model_summary, bool):
            raise ValueError(f"enable_model_summary={enable_model_summary!r} must be True or False")
        self.enable_model_summary = enable_model_summary
        self.min_epochs, self.min_steps = settings.minimums(min_epochs, min_steps, self.max_epochs, self.max_steps)
        self.benchmark = settings.flag("benchmark", benchmark, none_ok=True)
        self.inference_mode = settings.flag("inference_mode", inference_mode)
        self.sync_batchnorm = settings.flag("sync_batchnorm", sync_batchnorm)
        self.use_distributed_sampler = settings.flag("use_distributed_sampler", use_distributed_sampler)
        self.reload_dataloaders_every_n_epochs = arguments.int_in_range(
            "reload_dataloaders_every_n_epochs", reload_dataloaders_every_n_epochs, 0
        )
        self.enable_autolog_hparams = settings.flag("enable_autolog_hparams", enable_autolog_hparams)
        root = os.getcwd() if default_root_dir is None else arguments.path("default_root_dir", default_root_dir)
        url = as_url(root)
        if url is not None:
            raise ValueError(
                f"Trainer(default_root_dir={root!r}): logs are written to a local folder; keep default_root_dir "
                f"local and pass callbacks=[ModelCheckpoint(dirpath={url / 'checkpoints'!r})] "
                "to keep the checkpoints on object storage"
            )
        self.default_root_dir = Path(arguments.directory("default_root_dir", local_path(root)))
        self.rig = Rig(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            precision=precision,
            num_nodes=num_nodes,
            timeout=timeout,
            compile=compile,
            activation_checkpointing=activation_checkpointing,
        )
        self.callbacks = settings.callbacks(callbacks, enable_checkpointing, enable_progress_bar)
        if not enable_model_summary and settings.summary_depth(self) != 0:
            raise ValueError("enable_model_summary=False, but a ModelSummary is in callbacks; drop one of the two")
        self.loggers = settings.loggers(logger, self.default_root_dir)
        overfit = settings.batch_limit("overfit_batches", overfit_batches)
        self.fast_dev_run, self.overfit_batches, self.detect_anomaly = debugging.configure(
            self, fast_dev_run, overfit, detect_anomaly
        )
        for lg in self.loggers:
            attach = getattr(lg, "attach", None)
            if callable(attach):
                attach(self)
        self.should_stop = False
        self.interrupted = False
        self.fit_state = loops.FitState()
        self.module: TrainingModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        #: The objects of the runs (prepared module and loaders, metric stores, hook lists, clocks).
        self.run = loops.Run(self)
        if self.seed is not None:  # now too: a module built after the Trainer is the same in every run
            self.rig.seed_everything(self.seed)

    # -- what the run is at --------------------------------------------------------------------
    @property
    def current_epoch(self) -> int:
        """The epoch being trained (0-based); after a fit, the number of epochs run."""
        return self.fit_state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.fit_state.global_step

    @property
    def sanity_checking(self) -> bool:
        """Whether the fit's sanity check (validation batches before training) is running."""
        return self.run.sanity_checking

    @property
    def is_global_zero(self) -> bool:
        return self.rig.is_global_zero

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes of the run (0 to ``world_size - 1``)."""
        return self.rig.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank among the processes of its machine."""
        return self.rig.local_rank

    @property
    def node_rank(self) -> int:
        """The index of this process's machine (0 to ``num_nodes - 1``)."""
        return self.rig.node_rank

    @property
    def world_size(self) -> int:
        """How many processes take part in the run."""
        return self.rig.world_size

    @property
    def logger(self) -> Logger | None:
        """The first logger (None without one)."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> Path:
        """The logger's run directory, else ``default_root_dir``."""
        found = self.logger.log_dir if self.logger is not None else None
        return Path(found) if found is not None else self.default_root_dir

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """Every value logged in this run, as device tensors, as Lightning shows them: the
        training steps' latest values and the means of the ended epochs and evaluations (an
        evaluation's per-step values are not among them). A name logged both per step and per
        epoch holds its latest step value during the epoch and its mean once the epoch ends."""
        run = self.run
        train = run.train_metrics
        if not run.shows_training:
            return dict(run.epoch_metrics)
        current = {**train.step, **train.step_values()}
        return {**current, **run.epoch_metrics} if train.reduced else {**run.epoch_metrics, **current}

    @property
    def logged_metrics(self) -> dict[str, Any]:
        """The latest value of every name logged for the loggers in this run (as Lightning's:
        also when there is no logger, and without the ``epoch`` the loggers' rows carry)."""
        run = self.run
        stores = (run.train_metrics, run.eval_metrics) if run.shows_training else (run.eval_metrics,)
        out = dict(run.logged_all)
        out.pop("epoch", None)  # the loggers' x-axis, not a logged value
        for store in stores:
            out.update(store.step_values(for_logger=True))
        return out

    @property
    def progress_bar_metrics(self) -> dict[str, torch.Tensor]:
        """Values logged with ``prog_bar=True`` (device tensors; convert them when you draw)."""
        out = {**self.run.train_metrics.step_values(for_prog_bar=True)}
        names = {**self.run.train_metrics.options, **self.run.eval_metrics.options}
        for key, value in self.run.epoch_metrics.items():
            name = unforked_name(key, "epoch")
            opts = names.get(name) if name != key else names.get(key)
            if opts is not None and opts.prog_bar and (name != key or not (opts.on_step and opts.on_epoch)):
                out[key] = value  # a name logged per step and per epoch: its _step and _epoch forks only
        return out

    @property
    def datamodule(self) -> DataModule | None:
        """The datamodule of the run (given to ``fit``/``validate``/``test``/``predict``), or None."""
        datamodule: DataModule | None = self.run.datamodule
        return datamodule

    @property
    def is_last_batch(self) -> bool:
        """Whether the training batch being run is the last of its epoch (as Lightning's)."""
        return self.run.is_last_batch

    @property
    def num_training_batches(self) -> int | float:
        loader = self.run.train_loader
        return 0 if loader is None else num_batches(loader, self.limit_train_batches)

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps the whole fit takes: ``max_steps``, or ``max_epochs`` epochs of this
        process's training batches (``num_training_batches``, after ``limit_train_batches`` and the
        split across processes) in steps of ``accumulate_grad_batches`` (a partial group at an
        epoch's end is a step), whichever is fewer. Known inside ``configure_optimizers`` (size a
        OneCycle or warm-up schedule with it); ``inf`` when neither bounds it (a loader without a
        length and no ``max_steps``)."""
        self.run.ensure_train_loader()
        n = self.num_training_batches
        per_epoch = math.inf if math.isinf(n) else math.ceil(n / self.accumulate_grad_batches)
        epochs = math.inf if self.max_epochs == -1 else self.max_epochs
        steps = per_epoch * epochs if per_epoch else 0
        if self.max_steps != -1:
            steps = min(steps, self.max_steps)
        return steps if math.isinf(steps) else int(steps)

    @property
    def num_val_batches(self) -> list[int | float]:
        return [num_batches(d, self.limit_val_batches) for d in self.run.eval_loaders["validate"]]

    @property
    def num_test_batches(self) -> list[int | float]:
        return [num_batches(d, self.limit_test_batches) for d in self.run.eval_loaders["test"]]

    @property
    def num_predict_batches(self) -> list[int | float]:
        return [num_batches(d, self.limit_predict_batches) for d in self.run.eval_loaders["predict"]]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    # -- entry points ----------------------------------------------------------------------------
    def fit(
        self,
        module: TrainingModule,
        train_dataloaders: DataLoader[Any] | None = None,
        val_dataloaders: DataLoader[Any] | list[DataLoader[Any]] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Train ``module``; ``ckpt_path`` (a checkpoint directory, ``"last"`` or ``"best"``) resumes exactly.

        ``"last"``: the checkpoint callback's ``last``, else (default folder) the newest earlier run's,
        see docs/trainer.md. Ctrl-C saves ``last`` at the next optimizer step (one process), then
        raises ``KeyboardInterrupt``.
        """
        data = (train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        stages.launch(self, stages.run_fit_stage, module, module, *data)

    def validate(
        self,
        module: TrainingModule | None = None,
        dataloaders: DataLoader[Any] | list[DataLoader[Any]] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the loaders; the logged metrics, one dict per loader."""
        return self._evaluate("validate", module, dataloaders, datamodule, ckpt_path)

    def test(
        self,
        module: TrainingModule | None = None,
        dataloaders: DataLoader[Any] | list[DataLoader[Any]] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the loaders; the logged metrics, one dict per loader."""
        return self._evaluate("test", module, dataloaders, datamodule, ckpt_path)

    def predict(
        self,
        module: TrainingModule | None = None,
        dataloaders: DataLoader[Any] | list[DataLoader[Any]] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        return_predictions: bool = True,
    ) -> list[Any] | None:
        """``predict_step`` outputs per batch, gathered from every process in dataset order.

        ``return_predictions=False``: gather nothing and return None (each process keeps its own
        outputs, for a :class:`~torchrig.BasePredictionWriter` to write where they are).
        """
        self.run.return_predictions = settings.flag("return_predictions", return_predictions)
        return self._evaluate("predict", module, dataloaders, datamodule, ckpt_path)

    def _evaluate(self, stage: str, module: Any, dataloaders: Any, datamodule: Any, ckpt_path: Any) -> Any:
        return stages.launch(self, stages.run_eval_stage, module, stage, module, dataloaders, datamodule, ckpt_path)

    @overload
    def save_checkpoint(
        self, path: str | os.PathLike[str], *, link: str | None = ..., blocking: Literal[True] = ...
    ) -> Path: ...

    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], *, link: str | None = ..., blocking: bool) -> Any: ...

    def save_checkpoint(self, path: str | os.PathLike[str], *, link: str | None = None, blocking: bool = True) -> Any:
        """Save everything a resumed fit needs to the checkpoint directory ``path`` (all ranks call it).

        It writes that checkpoint and nothing else: no link moves, so a save inside a
        ``ModelCheckpoint``'s ``dirpath`` leaves the callback's ``last`` (what ``ckpt_path="last"``
        resumes from) where the callback put it. ``link="last"`` points the link of that name
        beside ``path`` at it (what ``ModelCheckpoint`` passes).

        ``blocking=False``: ``rig.save``'s background save; returns its
        :class:`~torchrig.checkpoint.SaveHandle` (the loggers hear of the checkpoint once it is committed).
        """
        if self.run.prepared_module is None:
            raise RuntimeError(self._no_run_to_save())
        state = resume.checkpoint_state(self)
        hparams = getattr(self.module, "hparams", None)
        if hparams:  # plain data (save_hyperparameters checked it): load_from_checkpoint builds the module from it
            state["hparams"] = dict(hparams)
        extra: dict[str, Any] = {}
        self.run.emit("on_save_checkpoint", extra)
        if extra:
            state["callback_extras"] = extra
        saved = self.rig.save(path, state, link=link, blocking=blocking)

        def committed(folder: Path | CheckpointURL) -> None:
            if isinstance(folder, CheckpointURL):
                return  # loggers record local checkpoint folders (docs/checkpoints.md, "Object storage")
            for lg in self.loggers:
                lg.after_save_checkpoint(folder)

        if isinstance(saved, SaveHandle):
            saved.add_commit_hook(committed)
        else:
            committed(saved)
        return saved

    def _no_run_to_save(self) -> str:
        """Why ``save_checkpoint`` has nothing to save in this process, and what to do."""
        if self.rig.strategy.needs_launch:
            return (
                f"trainer.save_checkpoint() saves a run, and under {type(self.rig.strategy).__name__} (ddp_spawn, "
                "ddp_notebook) the runs live in the processes each fit/validate/test starts; this launching process "
                "holds the trained weights (module.state_dict()) and where the fit ended, not the optimizers or the "
                "data's position. Save during the fit (ModelCheckpoint: trainer.checkpoint_callback.best_model_path "
                "and its 'last'), or call trainer.save_checkpoint() from a callback or hook inside it"
            )
        return "trainer.save_checkpoint() saves a run: call fit/validate/test/predict with a module first"
