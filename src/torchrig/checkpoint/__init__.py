"""Checkpoints you can trust: atomic, safe to load, complete, and bit-exact on resume.

A checkpoint is a directory::

    step-000100/
      meta.json            versions, world size, step/epoch, entries, SHA-256 + size of every file
      model.safetensors    one per module in the state (tied weights stored once); a large
                           module is cut into ~256 MB shards model@00000.safetensors, ...
      state.pt             optimizers, schedulers, scaler, dataloader positions, plain values,
                           RNG states (python, numpy, torch CPU and each device, per rank)
      state.pt@tensors*.safetensors   the large tensors of state.pt (optimizer moments), if any

or, under FSDP, DCP shards (``.metadata``, ``__R_0.distcp``) written by every rank in parallel
plus ``state.pt`` and ``meta.json``.

Guarantees:

* **Atomic**: files go into a hidden temp directory next to the target, each is fsynced, then
  ``meta.json``, then the directory, then it is renamed into place. A crash leaves the previous
  checkpoint or the new one. Errors (a full disk, a permission) are raised and the previous
  checkpoint stays. ``keep_last=K`` prunes older ones and the ``last`` symlink is replaced
  atomically.
* **Safe**: tensors load through safetensors, everything else through
  ``torch.load(weights_only=True)``; a pickle payload is refused without running it, and a
  file whose SHA-256 differs from ``meta.json`` is refused by name.
* **Bit-exact resume**: RNG states and the dataloader position are restored, so a resumed run
  continues at the next batch and ends bitwise equal to an uninterrupted one.
* **In the background** if asked: ``rig.save(path, state, blocking=False)`` takes a snapshot in
  host memory and returns a :class:`SaveHandle`; the same files are written and committed the
  same way on a background thread (:mod:`.background`).

Example:
    >>> import torch, torchrig, tempfile, os
    >>> rig = torchrig.Rig(accelerator="cpu")
    >>> model = torch.nn.Linear(2, 2)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> model, optimizer = rig.prepare(model, optimizer)
    >>> folder = tempfile.mkdtemp()
    >>> path = rig.save(os.path.join(folder, "step-1"), {"model": model, "optimizer": optimizer, "step": 1})
    >>> rig.load(os.path.join(folder, "last"), {"model": model, "optimizer": optimizer})["step"]
    1
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from torchrig import arguments
from torchrig.checkpoint.background import SaveHandle
from torchrig.checkpoint.core import load, read_whole, save
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.files import durable, follow_umask, fsync_dir
from torchrig.checkpoint.meta import STATE_FILE
from torchrig.checkpoint.reading import VerifiedReader, read_meta, safe_torch_load, verify_files
from torchrig.checkpoint.remote import CheckpointURL, fetched, remote_origin
from torchrig.checkpoint.sharded import consolidate_dcp, first_files

__all__ = [
    "CheckpointError",
    "CheckpointURL",
    "SaveHandle",
    "consolidate",
    "describe",
    "load",
    "module_weights",
    "read_values",
    "save",
]


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path`` plus ``verified``: ``(name, size, ok)`` per file.

    Example:
        >>> # info = torchrig.checkpoint.describe("checkpoints/last"); info["step"]
    """
    with fetched(path) as folder:
        meta = read_meta(folder)
        meta["path"] = remote_origin(path) or str(folder.resolve())  # where a ``last`` link points
        meta["verified"] = verify_files(folder, meta)
    return meta


def read_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path`` (its ``step``, ``epoch`` and plain ``values``),
    without checking its files: what a run decides before it loads the checkpoint.

    Example:
        >>> # torchrig.checkpoint.read_summary("checkpoints/last")["epoch"]
    """
    with fetched(path, lambda meta: ()) as folder:  # meta.json alone
        return read_meta(folder)


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model weights of a checkpoint (sharded or not) as one ``.safetensors`` file.

    With one module in the checkpoint its keys are kept as they are; with several, each key is
    prefixed by its entry name (``"model.fc.weight"``). Runs in one process, no process group.

    Example:
        >>> # torchrig.checkpoint.consolidate("checkpoints/last", "model.safetensors")
    """
    target = Path(out)
    with fetched(path, first_files) as folder:
        meta = read_meta(folder)
        _check_consolidate_target(target, folder)
        per_module = module_weights(folder)
    if not per_module:
        raise ValueError(f"{folder} holds no module weights to consolidate (entries: {sorted(meta['entries'])})")
    if len(per_module) == 1:
        flat: dict[str, torch.Tensor] = next(iter(per_module.values()))
    else:
        flat = {f"{k}.{n}": t for k, sd in per_module.items() for n, t in sd.items()}
    # Other readers know nothing of torchrig's alias metadata: tied weights get their own copy.
    seen: set[int] = set()
    for name, t in list(flat.items()):
        if t.untyped_storage().data_ptr() in seen:
            flat[name] = t.clone()
        seen.add(t.untyped_storage().data_ptr())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        safetensors.torch.save_file({k: t.contiguous() for k, t in flat.items()}, str(tmp))
        follow_umask(tmp)
        durable(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
        raise
    fsync_dir(target.parent)
    return target


def _check_consolidate_target(target: Path, checkpoint: Path) -> None:
    """``out`` of :func:`consolidate`: a file to write, outside the checkpoint it reads."""
    if target.is_dir():
        raise CheckpointError(
            f"out={str(target)!r} is a directory; give the file to write, such as {str(target / 'model.safetensors')!r}"
        )
    blocking = arguments.file_in_the_way(target.parent)
    if blocking is not None:
        raise CheckpointError(f"out={str(target)!r} cannot be written: {blocking} exists and is not a directory")
    source = checkpoint.resolve()
    if target.resolve().is_relative_to(source):
        raise CheckpointError(
            f"out={str(target)!r} is inside the checkpoint {source} it reads, whose files are checked against "
            "their SHA-256; write it elsewhere, such as beside the checkpoint"
        )


def module_weights(path: str | os.PathLike[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The full tensors of every module entry of a checkpoint (sharded or not), on the CPU, read in
    this process with no process group; every file is checked against its SHA-256 first.

    Example:
        >>> # torchrig.checkpoint.module_weights("checkpoints/last")["module"]["net.0.weight"]
    """
    with fetched(path, first_files) as folder:
        meta = read_meta(folder)
        if meta.get("sharded"):
            return consolidate_dcp(folder, meta)
        return read_whole(folder, meta, torch.device("cpu"))[1]


def read_values(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plain values a checkpoint holds (step, epoch, hparams...), read as ``load`` reads them:
    checked against ``meta.json``, with ``torch.load(weights_only=True)`` (no code runs).

    Example:
        >>> # torchrig.checkpoint.read_values("checkpoints/last")["step"]
    """
    with fetched(path, first_files) as folder:
        meta = read_meta(folder)
        if meta.get("sharded"):
            with VerifiedReader(folder, meta) as reader:
                blob = reader.read(STATE_FILE, lambda p: safe_torch_load(p, map_location="cpu"))
                reader.check()
        else:
            blob = read_whole(folder, meta, torch.device("cpu"), modules=False)[0]
    values = blob.get("values") if isinstance(blob, dict) else None
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} has no plain values in its state.pt; the checkpoint is damaged")
    return dict(values)
