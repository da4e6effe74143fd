"""A fit's checkpoint as the Trainer writes and reads it: what it holds (:func:`checkpoint_state`),
what ``ckpt_path`` names (a path, a URL, ``"best"``, ``"last"``; a restarted job's newest ``last``),
and loading it back so the fit continues at the batch after the one saved (:func:`resume`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrig import arguments
from torchrig.checkpoint import read_summary
from torchrig.checkpoint.meta import epoch_text
from torchrig.checkpoint.remote import CheckpointURL, as_url, lexists, local_path
from torchrig.data import RigDataLoader
from torchrig.preemption import restart_count
from torchrig.trainer.callbacks import overrides
from torchrig.trainer.checkpointing import checkpoint_epoch, default_checkpoint_dir, previous_run_last
from torchrig.trainer.datamodule import DataModule

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer


def checkpoint_state(tr: Trainer, saved: Collection[str] | None = None) -> dict[str, Any]:
    """The objects and values a checkpoint of this run holds (filled in place on resume, from a
    checkpoint with the entries ``saved``: the datamodule's only when the checkpoint has it)."""
    state: dict[str, Any] = {"module": tr.run.prepared_module, "precision": tr.rig.precision}
    datamodule = tr.run.datamodule
    keeps = isinstance(datamodule, DataModule) and overrides(datamodule, DataModule, "state_dict")
    if keeps and (saved is None or "datamodule" in saved):
        state["datamodule"] = datamodule
    for i, opt in enumerate(tr.optimizers):
        state[f"optimizer_{i}"] = opt
    for i, cfg in enumerate(tr.lr_scheduler_configs):
        state[f"scheduler_{i}"] = cfg.scheduler
    if tr.run.train_loader is not None:
        state["train_loader"] = tr.run.train_loader
    state["loop"] = tr.fit_state
    state["train_metrics"] = tr.run.train_metrics
    state["callbacks"] = {cb.state_key: cb.state_dict() for cb in tr.callbacks}
    for cb in tr.callbacks:  # tensors a callback keeps (EMA's average): module entries of their own
        state.update({f"{cb.state_key}.{name}": m for name, m in cb.checkpoint_modules(tr).items()})
    # The epoch its name shows (epoch=E), not the loop's counter, which a save between epochs
    # (the end of a fit) has already advanced past the epoch its last step trained in.
    state["step"], state["epoch"] = tr.fit_state.global_step, checkpoint_epoch(tr)
    return {k: v for k, v in state.items() if v is not None}


def resolve_path(tr: Trainer, ckpt_path: str | os.PathLike[str]) -> Path | CheckpointURL | None:
    cb = tr.checkpoint_callback
    arguments.path("ckpt_path", ckpt_path)
    if str(ckpt_path) == "best":
        if cb is None or not cb.best_model_path:
            raise ValueError(
                "ckpt_path='best' needs a ModelCheckpoint that has saved a checkpoint in this Trainer; "
                "give the checkpoint's path, or 'last'"
            )
        return as_url(cb.best_model_path) or Path(cb.best_model_path)
    if str(ckpt_path) != "last":
        return as_url(ckpt_path) or Path(local_path(ckpt_path))
    link = _last_link(tr)
    if not lexists(link):
        warnings.warn(f"ckpt_path='last': there is no checkpoint at {link} yet; starting from scratch", stacklevel=4)
        return None
    return link


def _last_link(tr: Trainer) -> Path | CheckpointURL:
    """What ``ckpt_path="last"`` names: ``last`` in the checkpoint folder; in the default folder
    (a new run's) without one, the ``last`` of the newest earlier run beside it.

    A ``last`` link that exists but points nowhere (a save was killed while replacing its
    checkpoint) is loaded: rig.load finds the previous copy, or raises; it never means "no checkpoint".
    """
    cb = tr.checkpoint_callback
    link = (cb.resolve_dirpath(tr) if cb is not None else default_checkpoint_dir(tr)) / "last"
    if not lexists(link) and (cb is None or cb.dirpath is None):
        link = previous_run_last(tr) or link
    return link


def auto_resume(tr: Trainer) -> None:
    """A restarted job's fit without ``ckpt_path``: resume from the newest ``last``, if any."""
    link, count = _last_link(tr), restart_count()
    if not lexists(link):
        tr.rig.print(f"torchrig: restart {count} of this job: no checkpoint at {link} yet; starting from scratch")
        return
    tr.rig.print(f"torchrig: restart {count} of this job: resuming from {link} (auto_resume=False turns this off)")
    resume(tr, link)


def resume(tr: Trainer, ckpt_path: str | os.PathLike[str]) -> None:
    """Load everything back; the loop continues at the batch after the one saved.

    The callbacks' state is loaded first, then ``on_restore_optimizers`` runs, then the
    optimizers, schedulers, module and the rest are loaded (``rig.load(..., prepare=)``)."""
    path = resolve_path(tr, ckpt_path)
    if path is None:
        return
    if tr.reload_dataloaders_every_n_epochs:  # the loaders of the epoch it last trained in, before loading their place
        epoch = read_summary(path).get("epoch")
        tr.run.reload_for_resume(int(epoch) if isinstance(epoch, int) else 0)
    saved = read_summary(path).get("entries", {})
    state = checkpoint_state(tr, saved)

    def restore_callbacks(values: dict[str, Any]) -> None:
        # Before the optimizers and schedulers: a callback that changed them in the saved run
        # (param groups added, a scheduler swapped in) makes them so again, so that they load.
        saved = values.get("callbacks", {})
        for cb in tr.callbacks:
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])
        tr.run.emit("on_restore_optimizers")
        state.update(checkpoint_state(tr, saved))

    left = tr.rig.load(path, state, prepare=restore_callbacks)
    align_batch_index(tr)
    if isinstance(path, CheckpointURL):  # retention never touches object storage it did not write
        tr.run.resumed_from, shown = None, str(path)
    else:
        tr.run.resumed_from = path.resolve()
        shown = f"{path} -> {tr.run.resumed_from.name}" if path.is_symlink() else str(tr.run.resumed_from)
    fs = tr.fit_state
    epoch = epoch_text(fs.epoch + 1 if fs.epoch_finished else fs.epoch, tr.max_epochs)  # as names and the bar
    mid = fs.batch_idx and not fs.epoch_finished
    where = f"in epoch {epoch} after {fs.batch_idx} batches" if mid else f"with epoch {epoch}"
    tr.rig.print(f"torchrig: resumed from {shown}: continues {where}, step {fs.global_step}")
    tr.run.emit("on_load_checkpoint", left.get("callback_extras", {}))
    tr.run.resumed = True


def align_batch_index(tr: Trainer) -> None:
    """Count the resumed epoch's batches in this run's batches.

    A checkpoint from another number of processes (or batch size) is converted by the loader
    through the global sample position; the fit state's batch index must follow it, or the end
    of the epoch (validation, the last accumulation boundary) would come at the wrong batch.
    """
    loader, state = tr.run.train_loader, tr.fit_state
    if not isinstance(loader, RigDataLoader) or state.epoch_finished:
        return
    if loader.epoch == state.epoch:
        state.batch_idx = loader.batches_seen
    elif loader.epoch == state.epoch + 1 and loader.batches_seen == 0:
        state.batch_idx = len(loader)  # the saved position was the end of that epoch's data
