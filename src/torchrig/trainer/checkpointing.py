"""``ModelCheckpoint``: save the run through ``rig.save`` on a schedule, keep the best ``k``."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrig import arguments
from torchrig.checkpoint.background import SaveHandle
from torchrig.checkpoint.meta import trained_epoch
from torchrig.checkpoint.remote import CheckpointURL, as_url, holds_checkpoint, local_path, remove_checkpoint
from torchrig.strategies.agreement import default_store, every_rank_arrives
from torchrig.trainer.callbacks import EVERY_TIME, Callback, EventSchedule
from torchrig.trainer.early_stopping import at_epoch_end
from torchrig.trainer.metrics import to_floats

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")
_VERSION = re.compile(r"^version_\d+$")
#: The folder of a run's checkpoints inside its run directory (``<root>/<name>/version_N``).
CHECKPOINTS = "checkpoints"


class ModelCheckpoint(Callback):
    """Saves resumable checkpoints (directories written atomically by :meth:`torchrig.Rig.save`).

    By default it saves at the end of every epoch; ``every_n_train_steps`` saves after every n
    optimizer steps instead (mid-epoch; a resumed fit continues at the next batch).

    Retention only ever deletes checkpoints this callback wrote into its own ``dirpath``: a
    stale entry is removed only when it is a checkpoint directory (with ``meta.json``) directly
    inside ``dirpath`` (both resolved), never a link, and never the checkpoint the fit resumed
    from. The kept list a checkpoint carries is taken back on resume only when it was written
    for the same ``dirpath``; resumed into another directory, this callback starts a new list
    (what the earlier directory holds stays as it is).

    Args:
        dirpath: where checkpoints go (default ``<logger's run directory>/checkpoints``, e.g.
            ``torchrig_logs/version_3/checkpoints``, so each run has its own; without a logger
            ``<default_root_dir>/checkpoints``). An fsspec URL (``s3://bucket/run``) keeps them on
            object storage (docs/checkpoints.md, "Object storage").
        filename: a name pattern with ``{epoch}``, ``{step}`` and logged metrics, e.g.
            ``"{epoch}-{val_loss:.3f}"`` (written as ``epoch=2-val_loss=0.123``). ``epoch`` is
            the 0-based index of the last epoch the saved state trained in (see
            :func:`checkpoint_epoch`): ``epoch=9`` after 10 epochs, as in Lightning.
        monitor: the logged metric that ranks checkpoints (None: the newest are kept).
        mode: ``"min"`` or ``"max"``: which ``monitor`` values are better.
        save_top_k: how many checkpoints to keep (``-1``: all; ``0``: none but ``last``).
        every_n_train_steps: save after every this many optimizer steps (with
            ``accumulate_grad_batches`` only after the micro-batch that ends a step, never inside one).
        every_n_epochs: save at the end of every this many epochs (default 1).
        save_last: keep the newest checkpoint too, pointed to by the ``last`` link in ``dirpath``
            (what ``Trainer.fit(ckpt_path="last")`` resumes from). The fit's final state is always
            saved as ``last``, also when the schedule did not fall on the final step.
        train_time_interval: save at most once every this many seconds of training (a save that
            falls due sooner is skipped); the state at the end of the fit is then saved too. The
            Trainer's default checkpoint uses 60 s, so runs with short epochs do not spend their
            time writing checkpoints.
        async_save: write checkpoints in the background (``rig.save(..., blocking=False)``): the
            step only copies the state to host memory. One save at a time (the next one waits for
            the previous), older checkpoints are removed only once the new one is committed, and
            the fit's end, an error and a stop signal wait for it. See docs/checkpoints.md, "Async saves".
        save_on_exception: when the fit raises an ``Exception`` (not ``KeyboardInterrupt`` or a
            stop signal, which save at a step of their own), save the state as it is as ``last``,
            then let the error go on. With several processes only when every rank raised at the
            same place within ``save_on_exception_timeout`` seconds (a save needs every rank; a rank
            that did not raise is stuck elsewhere); otherwise nothing is saved and the ranks that
            raised say so. See docs/trainer.md, "Errors and interrupts".
        save_on_exception_timeout: how long a rank that raised waits for the others to raise too.
        save_on_train_epoch_end: save (every ``every_n_epochs`` epochs) at each training epoch's
            end (True) or after each validation of the fit (False); None: as Lightning decides, for
            each fit: at the epoch's end when the fit validates at every epoch's end or never,
            after each validation when it validates several times an epoch or every few epochs.

    Example:
        >>> cb = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, save_last=True)
        >>> # Trainer(callbacks=[cb]).fit(module, train, val); cb.best_model_path
    """

    monitors_epoch_metrics = True  # on_train_epoch_end after the module's, once the epoch's metrics are in

    def __init__(
        self,
        *,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_last: bool = False,
        train_time_interval: float | None = None,
        async_save: bool = False,
        save_on_exception: bool = False,
        save_on_exception_timeout: float = 30.0,
        save_on_train_epoch_end: bool | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}); use 'min' or 'max'")
        arguments.int_in_range("save_top_k", save_top_k, -1, hint=" (-1 keeps all)")
        if monitor is None and save_top_k > 1:
            raise ValueError(
                f"ModelCheckpoint(save_top_k={save_top_k}) ranks checkpoints by a metric; pass monitor='val_loss' "
                "(or what you log), or save_top_k=-1 to keep every checkpoint"
            )
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None:
                arguments.int_in_range(name, value, 1, hint=", or None")
        if train_time_interval is not None and (
            isinstance(train_time_interval, bool)
            or not isinstance(train_time_interval, (int, float))
            or train_time_interval < 0
        ):
            raise ValueError(
                f"ModelCheckpoint(train_time_interval={train_time_interval!r}) must be seconds >= 0 or None"
            )
        if every_n_train_steps is not None and every_n_epochs is not None:
            raise ValueError("ModelCheckpoint takes every_n_train_steps or every_n_epochs, not both")
        url = None if dirpath is None else as_url(dirpath)
        local = None if dirpath is None or url else Path(arguments.directory("dirpath", local_path(dirpath)))
        self.dirpath = url or local
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.every_n_train_steps, self.every_n_epochs = every_n_train_steps, every_n_epochs or 1
        self.save_last = save_last
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.train_time_interval = train_time_interval
        if not isinstance(async_save, bool):
            raise TypeError(f"ModelCheckpoint(async_save={async_save!r}) must be True or False")
        self.async_save = async_save
        if not isinstance(save_on_exception, bool):
            raise TypeError(f"ModelCheckpoint(save_on_exception={save_on_exception!r}) must be True or False")
        self.save_on_exception = save_on_exception
        self.save_on_exception_timeout = arguments.finite_at_least(
            "ModelCheckpoint(save_on_exception_timeout", save_on_exception_timeout, 0.0, hint=" seconds)"
        )
        self._fits = 0  # fits started: the same count on every rank
        self._in_fit = False  # between on_fit_start and the fit's end
        self._last_save_time = 0.0
        self._skipped = False
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._saved: list[str] = []
        self._last_step_saved = -1
        self._seen_step = 0  # global_step at the previous batch end: a batch that moved it ended a step
        self._kept_in: str | None = None  # the resolved folder the kept list belongs to
        self._check_restored = False  # a checkpoint's kept list is to be checked against this run

    def resolve_dirpath(self, trainer: Trainer) -> Path | CheckpointURL:
        """Where this callback writes: ``dirpath``, else the Trainer's default checkpoint folder."""
        return self.dirpath if self.dirpath is not None else default_checkpoint_dir(trainer)

    def _folder(self, trainer: Trainer) -> Path | CheckpointURL:
        """:meth:`resolve_dirpath` resolved (a URL is its own name)."""
        folder = self.resolve_dirpath(trainer)
        return folder if isinstance(folder, CheckpointURL) else folder.resolve()

    # -- when ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._last_save_time, self._skipped = time.monotonic(), False
        self._seen_step = trainer.global_step  # after a resume: the step the fit continues from
        self._adopt_restored(trainer)
        self._fits, self._in_fit = self._fits + 1, True
        self._validated = False  # no validation of this fit has ended yet (a monitor may not exist yet)
        if self.save_on_exception:  # worked out now, with every rank: a save after an error must not ask
            self.resolve_dirpath(trainer)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.run.stage != "fit" or trainer.sanity_checking:
            return
        self._validated = True
        if not at_epoch_end(trainer, self.save_on_train_epoch_end):
            self._due_in_epoch(trainer)

    def _adopt_restored(self, trainer: Trainer) -> None:
        """Keep a resumed kept list only if it was written for this very folder (resolved)."""
        if not self._check_restored:
            return
        self._check_restored = False
        if self._kept_in != str(self._folder(trainer)):
            self.best_k_models, self._saved, self._kept_in = {}, [], None

    def event_schedule(self, event: str) -> EventSchedule:
        """By default it saves at epoch ends only: ``on_train_batch_end`` has nothing to do then
        and the Trainer does not call it (it asks at the start of each run)."""
        if event == "on_train_batch_end" and self.every_n_train_steps is None:
            return EventSchedule(enabled=False)
        return EVERY_TIME

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        if n is None:  # epoch ends only (not called by the Trainer then, see event_schedule)
            return
        # Only a batch that ended with an optimizer step (it moved global_step) is a whole step:
        # with accumulation the other micro-batches hold a partial gradient no checkpoint keeps.
        step, stepped = trainer.global_step, trainer.global_step != self._seen_step
        self._seen_step = step
        if stepped and step % n == 0 and step != self._last_step_saved:
            self._due(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if at_epoch_end(trainer, self.save_on_train_epoch_end):
            self._due_in_epoch(trainer)

    def _due_in_epoch(self, trainer: Trainer) -> None:
        """A save at an epoch's end or a validation's, unless the saves go by steps (or this
        epoch is not one of every ``every_n_epochs``)."""
        if self.every_n_train_steps is None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._due(trainer)

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._in_fit = False
        # The fit's final state: a save skipped by train_time_interval, or what `last` must hold
        # when the schedule did not fall on the final step (10 steps, every 3: step 10).
        if (self._skipped or self.save_last) and trainer.global_step != self._last_step_saved:
            self.save(trainer)
        self._wait_for_save(trainer)  # the fit ends with its checkpoints committed

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        """``save_on_exception``: save ``last`` when every rank raised at the same place of the fit."""
        self._wait_after_error(trainer, exception)
        if not (self.save_on_exception and self._in_fit and isinstance(exception, Exception)):
            return
        self._in_fit = False
        state, rig = trainer.fit_state, trainer.rig
        error = type(exception).__name__
        where = f"epoch {state.epoch}, batch {state.batch_idx}, step {state.global_step}"
        place = f"{self._fits}/{state.epoch}/{state.batch_idx}/{state.global_step}/{int(state.val_pending)}"
        key, timeout = f"save_on_exception/{place}", self.save_on_exception_timeout
        arrival = every_rank_arrives(default_store(), rig.world_size, key, timeout)
        if not arrival.everyone:
            if arrival.error is not None:
                why = f"the other ranks could not be asked ({arrival.error})"
            elif arrival.arrived < arrival.world_size:
                why = f"only {arrival.arrived} of {arrival.world_size} ranks raised there within {timeout:g} s"
            else:
                why = f"the ranks did not all raise there within {timeout:g} s of each other"
            print(
                f"torchrig: rank {rig.global_rank}: {error} at {where}, but {why}; a save needs every rank, so "
                "ModelCheckpoint(save_on_exception=True) saved nothing (the checkpoints written before stay). "
                "The error follows.",
                file=sys.stderr,
                flush=True,
            )
            return
        try:
            path = self.save_interrupted(trainer)
        except Exception as err:  # the error that stopped the fit goes on, not this one
            print(f"torchrig: rank {rig.global_rank}: save_on_exception could not save: {err!r}", file=sys.stderr)
            return
        rig.print(f"torchrig: {error} at {where}: saved it as {path} (last); the error follows", flush=True)

    def _due(self, trainer: Trainer) -> None:
        interval = self.train_time_interval
        if interval is not None:
            # Every rank must agree (a save is collective): rank zero's clock decides.
            soon = time.monotonic() - self._last_save_time < interval
            if trainer.rig.broadcast(soon):
                self._skipped = True
                return
        self.save(trainer)

    def _wait_for_save(self, trainer: Trainer) -> None:
        """A background save (``async_save``) still running is committed, and its retention done,
        before this returns; its error is raised here unless it was raised already."""
        from torchrig.checkpoint.core import settle_pending

        settle_pending(trainer.rig)

    def _wait_after_error(self, trainer: Trainer, exception: BaseException) -> None:
        """The fit raised: the background save still running is waited for all the same (the
        process must not end before it is committed); its own error is added to the fit's as a note."""
        try:
            self._wait_for_save(trainer)
        except BaseException as err:
            note = f"torchrig: the background checkpoint save failed as well: {type(err).__name__}: {err}"
            if hasattr(exception, "add_note"):  # Python 3.11+: shown with the fit's traceback
                exception.add_note(note)
            else:
                print(note, file=sys.stderr, flush=True)

    # -- what ------------------------------------------------------------------------------------
    def save(self, trainer: Trainer) -> Path | CheckpointURL | None:
        """Save now (on every rank); returns the path, or None when the score is not in the top k.

        With ``async_save`` the files are still being written when it returns (see :meth:`_wait_for_save`).
        """
        self._wait_for_save(trainer)  # the previous save's retention runs with the bookkeeping it was made with
        self._last_step_saved, self._last_save_time, self._skipped = trainer.global_step, time.monotonic(), False
        score = self._score(trainer)
        self._adopt_restored(trainer)
        folder = self._folder(trainer)
        path = self._unclaimed(folder, self.format_name(trainer)) if trainer.is_global_zero else None
        self._kept_in = str(folder)
        ranked = self.monitor is not None and self.save_top_k != 0
        keep = ranked and self._in_top_k(score)
        # Rank zero decides, so every rank takes part in the same saves (a save is collective).
        write = keep or self.save_last or (not ranked and self.save_top_k != 0)
        keep, write, path = trainer.rig.broadcast((keep, write, path))
        if not write:
            return None
        # The bookkeeping is updated first so that the checkpoint itself records it.
        key = str(path)
        if keep:
            self.best_k_models[key] = score  # type: ignore[assignment]
            if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
                self.best_k_models.pop(self._worst())
            best = min if self.mode == "min" else max
            self.best_model_path = best(self.best_k_models, key=self.best_k_models.__getitem__)
            self.best_model_score = self.best_k_models[self.best_model_path]
        elif not ranked and self.save_top_k != 0:
            newest = {key: float(trainer.global_step)}
            self.best_k_models = newest if self.save_top_k == 1 else {**self.best_k_models, **newest}
            self.best_model_path = key
        self.last_model_path = key
        if key not in self._saved:
            self._saved.append(key)
        saved = trainer.save_checkpoint(path, link="last" if self.save_last else None, blocking=not self.async_save)
        if isinstance(saved, SaveHandle):  # stale checkpoints go only once the new one is committed
            saved.add_commit_hook(lambda _: self._remove_stale(trainer))
        else:
            self._remove_stale(trainer)
        return path

    def save_interrupted(self, trainer: Trainer) -> Path | CheckpointURL:
        """Save the state of a fit stopped by a stop signal (Ctrl-C, SIGTERM...) at an optimizer
        step as ``last`` (every rank, the same step).

        Named by ``filename`` (by epoch and step where it uses a metric not logged yet); not
        ranked. Already saved at this step with ``save_last``: that checkpoint is ``last``.
        """
        self._wait_for_save(trainer)  # a background save is committed first (the requeue follows this)
        folder = self._folder(trainer)
        if self.save_last and self._last_step_saved == trainer.global_step and self.last_model_path:
            return as_url(self.last_model_path) or Path(self.last_model_path)
        self._adopt_restored(trainer)
        try:
            name = self.format_name(trainer)
        except ValueError:
            name = f"epoch={checkpoint_epoch(trainer)}-step={trainer.global_step}"
        path = trainer.rig.broadcast(self._unclaimed(folder, name) if trainer.is_global_zero else None)
        self._kept_in = str(folder)
        self._last_step_saved, self.last_model_path = trainer.global_step, str(path)
        if str(path) not in self._saved:
            self._saved.append(str(path))
        return trainer.save_checkpoint(path, link="last")

    def _unclaimed(self, folder: Path | CheckpointURL, name: str) -> Path | CheckpointURL:
        """``folder / name``, or where a checkpoint this callback did not write is there (an earlier
        run's in the same ``dirpath``), ``name-v1``, ``name-v2``... as Lightning names it: a new run
        never replaces another run's checkpoint. Anything else there is refused by the save."""
        path, version = folder / name, 0
        while str(path) not in self._saved and holds_checkpoint(path):
            version += 1
            path = folder / f"{name}-v{version}"
        return path

    def format_name(self, trainer: Trainer) -> str:
        """The directory name for the current epoch, step and metrics."""
        names = [m.group(1) for m in _FIELD.finditer(self.filename)]
        metrics = trainer.callback_metrics
        values: dict[str, Any] = {"epoch": checkpoint_epoch(trainer), "step": trainer.global_step}
        wanted = {n: metrics[n] for n in names if n in metrics and n not in values}
        values.update(to_floats(wanted))
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(
                f"ModelCheckpoint(filename={self.filename!r}) uses {missing}, which were not logged; "
                f"logged: {sorted(metrics) or 'none'}"
            )
        pattern = _FIELD.sub(lambda m: f"{m.group(1)}={{{m.group(1)}{m.group(2) or ''}}}", self.filename)
        if "=" in self.filename:  # the default pattern (or a user's) already says name=
            pattern = self.filename
        return pattern.format(**values).replace("/", "_")

    def _score(self, trainer: Trainer) -> float | None:
        if self.monitor is None:
            return None
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            message = (
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such logged metric; logged: "
                f"{sorted(metrics) or 'none'}. Log it with self.log({self.monitor!r}, value)"
            )
            if getattr(self, "_validated", True) or not trainer.run.has_validation():
                raise ValueError(message)
            # As Lightning: before the fit's first validation a validation metric cannot exist yet
            # (a save every n steps before it): a warning, and the save is not ranked.
            warnings.warn(f"{message}; this save is not ranked (no validation has run yet)", stacklevel=2)
        return float(metrics[self.monitor]) if self.monitor in metrics else None

    def _in_top_k(self, score: float | None) -> bool:
        if score is None or math.isnan(score):
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        worst = self.best_k_models[self._worst()]
        return score < worst if self.mode == "min" else score > worst

    def _worst(self) -> str:
        pick = max if self.mode == "min" else min
        return pick(self.best_k_models, key=self.best_k_models.__getitem__)

    def _remove_stale(self, trainer: Trainer) -> None:
        keep = set(self.best_k_models) | ({self.last_model_path} if self.save_last else set())
        stale = [p for p in self._saved if p not in keep]
        self._saved = [p for p in self._saved if p in keep]
        if not trainer.is_global_zero:
            return
        folder = self._folder(trainer)
        for p in stale:
            url = as_url(p)
            if url is not None:
                if url.parent == folder and url.name != "last":  # a checkpoint this callback wrote there
                    remove_checkpoint(url)
            elif isinstance(folder, Path) and _removable(Path(p), folder, trainer.run.resumed_from):
                shutil.rmtree(p, ignore_errors=True)

    # -- resumable -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_k_models": dict(self.best_k_models),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
            "saved": list(self._saved),
            "last_step_saved": self._last_step_saved,
            "dirpath": self._kept_in,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k_models = dict(state.get("best_k_models", {}))
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.last_model_path = state.get("last_model_path", "")
        self._saved = list(state.get("saved", []))
        self._last_step_saved = int(state.get("last_step_saved", -1))
        # Checked against this run's dirpath when the fit starts (kept only for the same folder).
        dirpath = state.get("dirpath")
        self._kept_in, self._check_restored = (dirpath if isinstance(dirpath, str) else None), True


def checkpoint_epoch(trainer: Trainer) -> int:
    """The ``epoch`` of a checkpoint's name: the 0-based index of the last epoch its state trained
    in, whenever it is saved: at that epoch's end (``epoch=9`` after 10 epochs), inside it, or
    after the fit or between epochs (when ``current_epoch`` already counts the finished ones)."""
    state = trainer.fit_state
    return trained_epoch(
        state.epoch, state.batch_idx, epoch_finished=state.epoch_finished, val_pending=state.val_pending
    )


def _removable(path: Path, folder: Path, resumed_from: Path | None) -> bool:
    """Whether retention may delete ``path``: a checkpoint directory (not a link) directly inside
    this callback's resolved ``folder``, and not the checkpoint the fit resumed from."""
    if not path.is_absolute() or path.is_symlink() or path.parent != folder or path.name == "last":
        return False
    if resumed_from is not None and path.resolve() == resumed_from:
        return False
    return path.is_dir() and (path / "meta.json").is_file()


def default_checkpoint_dir(trainer: Trainer) -> Path:
    """The Trainer's default checkpoint folder: ``checkpoints`` in the logger's run directory
    (``<root>/<name>/version_N/checkpoints``), else ``<default_root_dir>/checkpoints``.

    Worked out once per Trainer; rank zero's logger names the run directory, and every process
    takes its choice (a save is collective), so every call must come from every process.
    """
    found = trainer.run.checkpoint_dir
    if found is None:
        logger = trainer.logger
        log_dir = logger.log_dir if logger is not None and trainer.is_global_zero else None
        chosen = trainer.rig.broadcast(None if log_dir is None else str(log_dir))
        found = (Path(chosen) if chosen is not None else trainer.default_root_dir) / CHECKPOINTS
        trainer.run.checkpoint_dir = found
    return found


def previous_run_last(trainer: Trainer) -> Path | None:
    """``ckpt_path="last"`` when this run has no ``last`` yet: the ``checkpoints/last`` of the
    highest-numbered ``version_N`` beside the logger's run directory that has one (None if none)."""
    run_dir = default_checkpoint_dir(trainer).parent
    if trainer.logger is None or _VERSION.match(run_dir.name) is None:
        return None
    newest = newest_run_with_last(run_dir.parent)
    return None if newest is None else newest / CHECKPOINTS / "last"


def newest_run_with_last(parent: str | os.PathLike[str]) -> Path | None:
    """The highest-numbered ``parent/version_N`` with a ``checkpoints/last``, or None."""
    folder = Path(parent)
    if not folder.is_dir():
        return None
    runs = [p for p in folder.iterdir() if _VERSION.match(p.name) and os.path.lexists(p / CHECKPOINTS / "last")]
    return max(runs, key=lambda p: int(p.name.removeprefix("version_")), default=None)
