"""Checkpoints of other libraries as torchrig checkpoints (``torchrig checkpoint import PATH OUT``).

A Lightning ``.ckpt`` file or a directory written by Accelerate's ``save_state`` is read without
running anything it holds (``torch.load(weights_only=True)``, safetensors; a file that names
other Python objects is refused with their names) and written with torchrig's own atomic
checkpoint writer under the names a :class:`~torchrig.Trainer` resumes from:

========================  ===========================================================
``module``                the module weights (``module_1``... for Accelerate's further models)
``optimizer_0``...        the optimizer state dicts, with the class each was saved from
``scheduler_0``...        the LR scheduler state dicts, likewise
``loop``, ``train_loader``  where the fit stood: the epoch, the batches of it trained, the step
``precision``, ``train_metrics``, ``callbacks``  empty states (a fresh scaler, no running sums)
``step``, ``epoch``       plain values; ``hparams`` from Lightning's ``hyper_parameters``
========================  ===========================================================

plus the RNG states (Accelerate's ``random_states_*.pkl``; Lightning keeps none, so those of a
seed). What has no torchrig counterpart is listed in :attr:`Imported.warnings`.

The readers are :mod:`.lightning` and :mod:`.accelerate` (each fills a :class:`.sources.Peer`);
:mod:`.classes` names the optimizer and scheduler classes; this module writes the checkpoint.

Example:
    >>> # imported = import_checkpoint("epoch=1-step=4.ckpt", "ckpt/imported")
    >>> # rig.load("ckpt/imported", {"module": model, "optimizer_0": optimizer})
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrig import arguments
from torchrig.checkpoint.core import write
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.meta import trained_epoch
from torchrig.checkpoint.peers.accelerate import read_accelerate
from torchrig.checkpoint.peers.classes import optimizer_class, scheduler_class
from torchrig.checkpoint.peers.lightning import read_lightning
from torchrig.checkpoint.peers.sources import Peer
from torchrig.checkpoint.storable import check_weights_only
from torchrig.checkpoint.targets import check_target
from torchrig.checkpoint.tensors import split_module_state

__all__ = ["Imported", "import_checkpoint"]


@dataclass
class Imported:
    """What :func:`import_checkpoint` wrote: the checkpoint, where each part went, and what it left out."""

    path: Path
    source: str
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def import_checkpoint(
    path: str | Path,
    out: str | Path,
    *,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    optimizers: list[str] | tuple[str, ...] = (),
    schedulers: list[str] | tuple[str, ...] = (),
    seed: int = 0,
) -> Imported:
    """Write the Lightning ``.ckpt`` file or Accelerate ``save_state`` directory ``path`` as the
    torchrig checkpoint directory ``out`` (replacing a torchrig checkpoint there, atomically).

    Args:
        path: a Lightning checkpoint file, or the directory ``Accelerator.save_state`` wrote.
        out: the checkpoint directory to write; an existing one must be a torchrig checkpoint.
        strip_prefix: keep only the module keys that start with it, without it
            (``"model."``: Lightning's ``model.weight`` becomes ``weight``).
        add_prefix: put it before every module key, after ``strip_prefix``.
        optimizers: the class of each optimizer in order (``"torch.optim.AdamW"``); those not
            given are inferred from the fields of their parameter groups.
        schedulers: likewise for the LR schedulers (inferred from their state's fields).
        seed: the RNG states written when the source holds none (Lightning): those of this seed.

    Returns:
        An :class:`Imported` with the path written, a line per entry and the warnings.
    """
    arguments.int_in_range("seed", seed, 0, 2**32 - 1, hint=" (NumPy's seeds)")
    src, target = Path(path), Path(out).absolute()
    if src.is_file():
        src = src.resolve()  # the file a link names (files inside an Accelerate folder must be regular)
    check_target(target)
    if src.is_dir():
        peer = read_accelerate(src, seed)
    elif src.exists():
        peer = read_lightning(src, seed)
    else:
        raise CheckpointError(
            f"{src} does not exist: give a Lightning .ckpt file or the directory Accelerate's save_state wrote"
        )
    for key in list(peer.modules):
        peer.modules[key] = _rename(peer.modules[key], strip_prefix, add_prefix, key, peer.warnings)
    payload = _payload(peer, list(optimizers), list(schedulers))
    try:
        check_weights_only(payload["blob"])
    except TypeError as err:  # read with weights_only, so plain already; said as a checkpoint error all the same
        raise CheckpointError(f"{src} holds state torchrig cannot store: {err}") from None
    origin = types.SimpleNamespace(world_size=len(peer.rng), device=torch.device("cpu"), precision=None)
    write(origin, target, payload, keep_last=None, link=None)
    return Imported(target, peer.source, peer.lines, peer.warnings)


def _rename(sd: dict[str, Any], strip: str | None, add: str | None, key: str, notes: list[str]) -> dict[str, Any]:
    if strip:
        inside = {k[len(strip) :]: v for k, v in sd.items() if k.startswith(strip)}
        if not inside or "" in inside:
            shown = ", ".join(list(sd)[:6])
            why = "one key is the prefix itself" if inside else "no key starts with it"
            raise ValueError(f"--strip-prefix {strip!r}: {why}; the keys of {key} are {shown}")
        left = [k for k in sd if not k.startswith(strip)]
        if left:
            notes.append(
                f"--strip-prefix {strip!r} leaves out {len(left)} keys of {key} outside it: {', '.join(left[:6])}"
            )
        sd = inside
    if add:
        sd = {add + k: v for k, v in sd.items()}
    return sd


def _payload(peer: Peer, optimizers: list[str], schedulers: list[str]) -> dict[str, Any]:
    """What :func:`torchrig.checkpoint.core.write` writes, as ``collect`` makes it from live objects."""
    modules, extras, entries = {}, {}, {}
    floats = 0
    for key, sd in peer.modules.items():
        modules[key], extras[key] = split_module_state(sd)
        kind = f"{peer.source.split()[0].lower()} module"
        entries[key] = {"kind": "module", "type": kind, "file": f"{key}.safetensors"}
        floats += sum(t.numel() for t in modules[key].values() if t.is_floating_point())
        peer.lines.append(f"{key}: {len(sd)} tensors ({_names(sd)})")
    objects: dict[str, Any] = {}
    if len(optimizers) > len(peer.optimizers) or len(schedulers) > len(peer.schedulers):
        raise ValueError(
            f"{len(optimizers)} --optimizer and {len(schedulers)} --scheduler classes given, but the checkpoint holds "
            f"{len(peer.optimizers)} optimizers and {len(peer.schedulers)} schedulers"
        )
    for i, (n, sd) in enumerate(sorted(peer.optimizers.items())):
        name, how = optimizer_class(sd, optimizers[i] if i < len(optimizers) else None, f"optimizer {n}")
        objects[f"optimizer_{n}"] = sd
        entries[f"optimizer_{n}"] = {"kind": "state", "type": name}
        peer.lines.append(f"optimizer_{n}: {name} ({how})")
    for i, (n, sd) in enumerate(sorted(peer.schedulers.items())):
        name, how = scheduler_class(sd, schedulers[i] if i < len(schedulers) else None, f"scheduler {n}")
        objects[f"scheduler_{n}"] = sd
        entries[f"scheduler_{n}"] = {"kind": "state", "type": name}
        peer.lines.append(f"scheduler_{n}: {name} ({how})")
    loop = {
        "epoch": peer.epoch,
        "batch_idx": peer.batches,
        "global_step": peer.step,
        "epoch_finished": peer.epoch_finished,
        "val_pending": False,
    }
    loader = (
        {"epoch": peer.epoch + 1, "batches_seen": 0}
        if peer.epoch_finished
        else {"epoch": peer.epoch, "batches_seen": peer.batches}
    )
    fixed = {
        "precision": ({}, "torchrig.precision.Precision"),
        "train_loader": (loader, "torchrig.data.RigDataLoader"),
        "loop": (loop, "torchrig.trainer.loops.FitState"),
        "train_metrics": ({"sums": {}, "counts": {}, "options": {}}, "torchrig.trainer.metrics.MetricStore"),
    }
    for key, (value, kind) in fixed.items():
        objects[key] = value
        entries[key] = {"kind": "state", "type": kind}
    epoch = trained_epoch(peer.epoch, peer.batches, epoch_finished=peer.epoch_finished, val_pending=False)
    values = {"callbacks": {}, **peer.values, "step": peer.step, "epoch": epoch}  # as a Trainer's save records it
    entries.update({k: {"kind": "value", "type": f"builtins.{type(v).__name__}"} for k, v in values.items()})
    peer.lines.append(f"step {peer.step}, epoch {epoch}")
    blob = {"objects": objects, "values": values, "module_extras": extras, "rng": peer.rng}
    return {"modules": modules, "blob": blob, "entries": entries, "counts": {"parameters": floats}}


def _names(sd: dict[str, Any]) -> str:
    names = list(sd)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
