"""The layout of a checkpoint directory: the names of its files and the schema of ``meta.json``.

Pure data checks, no I/O: :func:`validate_meta` is the one gate every reader passes a parsed
``meta.json`` through (:func:`torchrig.checkpoint.reading.read_meta`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchrig.checkpoint.errors import CheckpointError

META = "meta.json"
FORMAT = "torchrig.checkpoint"
FORMAT_VERSION = 2  # 2: tensors may be split over several safetensors files
STATE_FILE = "state.pt"  # everything but module weights (and, sharded, the DCP shards)
STATE_TENSORS = "state.pt@tensors"  # large tensors of state.pt (optimizer moments); keys cannot hold "@"
DCP_METADATA = ".metadata"  # DCP's metadata file in a sharded checkpoint
META_LIMIT = 64 << 20  # a meta.json lists files and entries: far below this
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = ("module", "state", "value", "optimizer")
_HIDDEN_FILES = (DCP_METADATA,)  # the one hidden name a checkpoint lists


def trained_epoch(epoch: int, batch_idx: int, *, epoch_finished: bool, val_pending: bool) -> int:
    """The ``epoch`` of a Trainer checkpoint (its ``meta.json`` and its name ``epoch=E-step=S``)
    from the loop position it holds: the 0-based index of the last epoch that position trained
    in. At a batch of ``epoch`` or its end, ``epoch``; between epochs (batch 0 of ``epoch``,
    nothing of it run: the end of a fit), the epoch before. Lightning names its epoch-end
    checkpoints the same way.

    Example:
        >>> trained_epoch(3, 0, epoch_finished=False, val_pending=False)  # after 3 epochs
        2
        >>> trained_epoch(2, 8, epoch_finished=True, val_pending=False)  # at the end of the third
        2
    """
    between_epochs = batch_idx == 0 and not epoch_finished and not val_pending
    return epoch - 1 if between_epochs and epoch > 0 else epoch


def epoch_text(epoch: int, max_epochs: Any = None) -> str:
    """How every text torchrig prints names an epoch: counted from 0, as checkpoint names
    (``epoch=2-step=30``, :func:`trained_epoch`), ``trainer.current_epoch`` and the logged
    ``epoch`` count it, with the fit's last epoch after a slash when ``max_epochs`` bounds it
    (Lightning's rich progress bar says it the same way).

    Example:
        >>> epoch_text(2, 10)
        '2/9'
    """
    last = f"/{max_epochs - 1}" if isinstance(max_epochs, int) and max_epochs > 0 else ""
    return f"{epoch}{last}"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def plain_key(key: Any) -> bool:
    """A state key: it names files of the checkpoint, so letters, digits, ``_``, ``-``, ``.``, not hidden."""
    return isinstance(key, str) and bool(key) and all(c.isalnum() or c in "_-." for c in key) and key[0] != "."


def confined_name(name: Any) -> bool:
    """A plain file name inside the checkpoint folder: no separator, no ``..``, not absolute, not hidden."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and not any(c in name for c in "/\\\0:")
        and name not in (".", "..", META)
        and (not name.startswith(".") or name in _HIDDEN_FILES)
    )


def validate_meta(meta: Any, source: Path) -> dict[str, Any]:
    """``meta`` (parsed ``meta.json``) if it has the shape torchrig writes; else a :class:`CheckpointError`
    naming the field (``.../meta.json: files['x'].size must be a non-negative integer, got 'x'``).

    Every reader of a checkpoint goes through this one check, so later code can index the
    fields without guarding each one.
    """

    def need(ok: bool, field: str, want: str, got: Any) -> None:
        if not ok:
            raise CheckpointError(f"{source}: {field} must be {want}, got {_shown(got)}; the checkpoint is damaged")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a torchrig checkpoint description (format != {FORMAT!r})")
    version = meta.get("version", 0)
    need(_is_int(version), "version", "a non-negative integer", version)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{source.parent} was written by a newer torchrig (checkpoint format {version}, this one reads "
            f"up to {FORMAT_VERSION}); upgrade torchrig to load it"
        )
    for field, fits, want in (
        ("sharded", lambda v: isinstance(v, bool), "true or false"),
        ("world_size", lambda v: _is_int(v, 1), "a positive integer"),
        ("tensors", _is_int, "a non-negative integer"),
        ("parameters", _is_int, "a non-negative integer"),
        ("buffers", _is_int, "a non-negative integer"),
        ("saved_at_ns", _is_int, "a non-negative integer"),
        ("save_count", _is_int, "a non-negative integer"),
        ("values", lambda v: isinstance(v, dict), "a JSON object"),
        ("step", lambda v: v is None or isinstance(v, (int, float, str)), "a number, a string or null"),
        ("epoch", lambda v: v is None or isinstance(v, (int, float, str)), "a number, a string or null"),
        *(
            (name, lambda v: v is None or isinstance(v, str), "a string or null")
            for name in ("created", "torch", "torchrig", "device_type", "precision")
        ),
    ):
        if field in meta:
            need(fits(meta[field]), field, want, meta[field])
    files: Any = meta.get("files")
    need(isinstance(files, dict), "files", "a JSON object of file names", files)
    for name, entry in files.items():
        if not confined_name(name):
            raise CheckpointError(
                f"{source}: files lists {name!r}, which is not a plain file name inside the checkpoint folder "
                "(no '/', '..', absolute or hidden names); refusing to read it"
            )
        need(isinstance(entry, dict), f"files[{name!r}]", "a JSON object with size and sha256", entry)
        need(_is_int(entry.get("size")), f"files[{name!r}].size", "a non-negative integer", entry.get("size"))
        sha = entry.get("sha256")
        need(isinstance(sha, str) and bool(_SHA256.fullmatch(sha)), f"files[{name!r}].sha256", "64 hex digits", sha)
    if meta.get("sharded") and _HIDDEN_FILES[0] not in files:  # DCP reads it: it must be checked like the rest
        raise CheckpointError(f"{source}: files must list {_HIDDEN_FILES[0]} in a sharded checkpoint; it is damaged")
    entries: Any = meta.get("entries")
    need(isinstance(entries, dict), "entries", "a JSON object of state keys", entries)
    for key, entry in entries.items():
        where = f"entries[{key!r}]"
        if not plain_key(key):
            raise CheckpointError(f"{source}: {where} is not a plain state key; the checkpoint is damaged")
        need(isinstance(entry, dict), where, "a JSON object with kind and type", entry)
        need(entry.get("kind") in _KINDS, f"{where}.kind", f"one of {', '.join(_KINDS)}", entry.get("kind"))
        need(isinstance(entry.get("type"), str), f"{where}.type", "a string", entry.get("type"))
        need(isinstance(entry.get("dcp", False), bool), f"{where}.dcp", "true or false", entry.get("dcp"))
        if entry["kind"] != "module" or entry.get("dcp"):
            continue
        field = f"{where}.files" if "files" in entry else f"{where}.file"
        listed = entry["files"] if "files" in entry else [entry.get("file")]
        named = isinstance(listed, list) and len(listed) > 0 and all(isinstance(n, str) and n in files for n in listed)
        need(named, field, "names of files listed under files", listed if "files" in entry else entry.get("file"))
    return meta
