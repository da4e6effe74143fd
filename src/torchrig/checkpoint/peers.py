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

Example:
    >>> # imported = import_checkpoint("epoch=1-step=4.ckpt", "ckpt/imported")
    >>> # rig.load("ckpt/imported", {"module": model, "optimizer_0": optimizer})
"""

from __future__ import annotations

import functools
import importlib
import inspect
import io
import random
import re
import types
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch.optim import lr_scheduler

from torchrig import arguments
from torchrig.checkpoint.core import write
from torchrig.checkpoint.entries import class_name
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.meta import META
from torchrig.checkpoint.reading import read_regular, safe_torch_load
from torchrig.checkpoint.storable import check_weights_only
from torchrig.checkpoint.tensors import split_module_state
from torchrig.trainer.hparams import HPARAMS_KEY, check_plain

__all__ = ["Imported", "import_checkpoint"]

_LIGHTNING_KNOWN = {
    "epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
    "optimizer_states", "lr_schedulers", "hyper_parameters", "hparams_name", "hparams_type",
}  # fmt: skip
_SCALER_KEYS = ("MixedPrecision", "native_amp_scaling_state", "MixedPrecisionPlugin")
# What numpy needs to rebuild the arrays of Accelerate's RNG file: an array of a plain dtype.
_NUMPY_ARRAY_GLOBALS = {
    "numpy.dtype", "numpy.ndarray", "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType", "numpy.dtypes.Int64DType", "numpy.dtypes.Float64DType",
}  # fmt: skip


@dataclass
class Imported:
    """What :func:`import_checkpoint` wrote: the checkpoint, where each part went, and what it left out."""

    path: Path
    source: str
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Peer:
    source: str
    modules: dict[str, dict[str, Any]]
    optimizers: dict[int, Any] = field(default_factory=dict)
    schedulers: dict[int, Any] = field(default_factory=dict)
    step: int = 0
    epoch: int = 0
    batches: int = 0  # batches of ``epoch`` trained
    epoch_finished: bool = False
    rng: list[dict[str, Any]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
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
    _check_target(target)
    if src.is_dir():
        peer = _read_accelerate(src, seed)
    elif src.exists():
        peer = _read_lightning(src, seed)
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


# -- reading files without running them ------------------------------------------------------
def _torch_file(path: Path, what: str, allowed: set[str] | frozenset[str] = frozenset()) -> Any:
    """A ``torch.save`` file read with ``weights_only=True`` (``allowed`` numpy globals aside);
    one that names any other Python object is refused with their names, before anything runs."""
    data = read_regular(path)
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise CheckpointError(
            f"{path} is not {what}: it is not a torch.save file (a zip archive; its first bytes are {data[:16]!r})"
        )
    try:
        names = list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception as err:
        raise CheckpointError(f"{path} is not {what}: torch cannot read it ({type(err).__name__}: {err})") from None
    extra = [n for n in names if n not in allowed]
    if extra:
        raise CheckpointError(
            f"refusing to import {path}: it holds Python objects other than tensors and plain containers "
            f"({', '.join(extra)}), which could run code when unpickled; nothing in the file was run"
        )
    try:
        if not names:
            return safe_torch_load(path, map_location="cpu", data=data)
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"could not read {path} ({what}): {type(err).__name__}: {err}") from None


def _numpy_globals() -> list[Any]:
    """The objects of :data:`_NUMPY_ARRAY_GLOBALS` (NumPy 1 named its module ``numpy.core``)."""
    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)]
    return [np.dtype, np.ndarray, reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), *dtypes]


def _safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return dict(safetensors.torch.load(read_regular(path)))
    except Exception as err:
        raise CheckpointError(f"could not read {path} as safetensors: {type(err).__name__}: {err}") from None


# -- Lightning ---------------------------------------------------------------------------------
def _read_lightning(path: Path, seed: int) -> _Peer:
    ck = _torch_file(path, "a Lightning checkpoint")
    if not isinstance(ck, dict) or not isinstance(ck.get("state_dict"), dict):
        has = sorted(map(str, ck))[:8] if isinstance(ck, dict) else type(ck).__name__
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it has no 'state_dict' dict (it holds {has})")
    version = ck.get("pytorch-lightning_version")
    peer = _Peer(f"Lightning {version}" if isinstance(version, str) else "Lightning", {"module": ck["state_dict"]})
    peer.step, peer.epoch = _count(ck, "global_step", path), _count(ck, "epoch", path)
    for kind, store in (("optimizer_states", peer.optimizers), ("lr_schedulers", peer.schedulers)):
        listed = ck.get(kind, [])
        if not isinstance(listed, list):
            raise CheckpointError(f"{path}: {kind} is a {type(listed).__name__}, not a list of state dicts")
        store.update(enumerate(listed))
    _lightning_position(peer, ck.get("loops"))
    callbacks = ck.get("callbacks") or {}
    if callbacks:
        names = sorted({str(k).split("{", 1)[0] for k in callbacks})
        peer.warnings.append(
            f"the state of Lightning's callbacks is not carried over ({', '.join(names)}); "
            "torchrig's callbacks start fresh"
        )
    for key in _SCALER_KEYS:
        if key in ck:
            peer.warnings.append(
                f"the AMP gradient scaler state ({key}) is not carried over: a resumed fp16 run starts with a "
                "fresh scale"
            )
    hparams = ck.get("hyper_parameters")
    if hparams is not None:
        _take_hparams(peer, hparams)
    rest = sorted(str(k) for k in ck if k not in _LIGHTNING_KNOWN and k not in _SCALER_KEYS)
    if rest:
        peer.warnings.append(f"not carried over: {', '.join(rest)} (no torchrig counterpart)")
    peer.rng = [_seeded_rng(seed)]
    peer.warnings.append(
        f"Lightning checkpoints hold no RNG state: the checkpoint holds that of seed {seed} (as after "
        "torch.manual_seed, random.seed and numpy.random.seed with it; --seed picks another)"
    )
    return peer


def _count(ck: dict[str, Any], key: str, path: Path) -> int:
    value = ck.get(key, 0)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path}: {key} is {value!r}, not a non-negative integer; not a Lightning checkpoint")
    return value


def _lightning_position(peer: _Peer, loops: Any) -> None:
    """The epoch and the batches of it trained, from the fit loop's progress counters.

    Lightning's ``epoch`` is the epoch under way when it saved (or the next one, saved between
    epochs); ``epoch_progress.total.processed`` counts the epochs whose batches all ran, and
    ``epoch_loop.batch_progress.current.processed`` the batches of the epoch under way.
    """
    try:
        fit = loops["fit_loop"]
        epochs = fit["epoch_progress"]["total"]
        batches = int(fit["epoch_loop.batch_progress"]["current"]["processed"])
        processed, started = int(epochs["processed"]), int(epochs["started"])
    except (KeyError, TypeError, ValueError):
        peer.warnings.append(
            f"the checkpoint has no Lightning loop state: a Trainer starts epoch {peer.epoch} (counted from 0) at its "
            "first batch"
        )
        return
    if processed > peer.epoch:
        peer.batches, peer.epoch_finished = batches, True
        where = (
            f"epoch {peer.epoch} (counted from 0) finished after {batches} batches: a Trainer continues with epoch "
            f"{peer.epoch + 1}"
        )
    elif started > peer.epoch and batches:
        peer.batches = batches
        where = f"epoch {peer.epoch} (counted from 0) stopped after {batches} batches: a Trainer continues it there"
        peer.warnings.append(
            f"Lightning saved inside epoch {peer.epoch}: its sampler's order is not in the checkpoint, so the rest of "
            "the epoch comes in torchrig's order (the batches skipped are counted, not the samples)"
        )
    else:
        where = f"a Trainer starts epoch {peer.epoch} (counted from 0) at its first batch"
    peer.warnings.append(f"Lightning's loop state is not carried over, only the position it records ({where})")


def _take_hparams(peer: _Peer, hparams: Any) -> None:
    try:
        if not isinstance(hparams, dict):
            raise ValueError(f"it is a {type(hparams).__name__}, not a dict")
        check_plain(hparams, "hyper_parameters")
    except ValueError as err:
        peer.warnings.append(f"hyper_parameters are not carried over: {err}")
        return
    peer.values[HPARAMS_KEY] = dict(hparams)
    peer.lines.append(f"{HPARAMS_KEY}: Lightning's hyper_parameters ({', '.join(map(str, hparams)) or 'none'})")


# -- Accelerate --------------------------------------------------------------------------------
_ACCELERATE = re.compile(
    r"(?P<kind>model|pytorch_model|optimizer|scheduler)(?:_(?P<n>[0-9]+))?\.(?P<ext>safetensors|bin)"
    r"|random_states_(?P<rank>[0-9]+)\.pkl"
)


def _read_accelerate(folder: Path, seed: int) -> _Peer:
    names = sorted(p.name for p in folder.iterdir())
    peer = _Peer("Accelerate", {})
    rngs: dict[int, Path] = {}
    for name in names:
        p = folder / name
        m = _ACCELERATE.fullmatch(name)
        if m is None or not p.is_file():
            peer.warnings.append(_accelerate_left_out(name, p.is_dir()))
            continue
        if m["rank"] is not None:
            rngs[int(m["rank"])] = p
            continue
        n, kind = int(m["n"] or 0), m["kind"]
        if kind in ("model", "pytorch_model"):
            if (kind, m["ext"]) not in (("model", "safetensors"), ("pytorch_model", "bin")):
                peer.warnings.append(_accelerate_left_out(name, False))
                continue
            sd = _safetensors_file(p) if m["ext"] == "safetensors" else _torch_file(p, "a saved model state")
            if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
                raise CheckpointError(f"{p} is not a model state dict (names to tensors)")
            peer.modules["module" if n == 0 else f"module_{n}"] = sd
        elif m["ext"] == "bin":
            store = peer.optimizers if kind == "optimizer" else peer.schedulers
            store[n] = _torch_file(p, f"an Accelerate {kind} state")
        else:
            peer.warnings.append(_accelerate_left_out(name, False))
    if not peer.modules:
        raise CheckpointError(
            f"{folder} is not a directory Accelerate's save_state wrote: it has no model.safetensors or "
            f"pytorch_model.bin (it has {', '.join(names[:8]) if names else 'nothing'}); a sharded Lightning "
            "checkpoint directory cannot be imported"
        )
    if rngs:
        states = [_accelerate_rng(rngs[r]) for r in sorted(rngs)]
        peer.rng = [rng for rng, _ in states]
        steps = {step for _, step in states if step is not None}
        peer.step = max(steps) if steps else 0
    else:
        peer.rng = [_seeded_rng(seed)]
        peer.warnings.append(f"no random_states_*.pkl: the checkpoint holds the RNG state of seed {seed}")
    peer.warnings.append(
        f"Accelerate records no epoch: the checkpoint says epoch 0, and step {peer.step} is accelerator.step "
        "(steps counted under accelerator.accumulate)"
    )
    return peer


def _accelerate_left_out(name: str, is_dir: bool) -> str:
    if re.fullmatch(r"(sampler|dl_state_dict)(_[0-9]+)?\.bin", name):
        return f"not carried over: {name} (the dataloader's position; the loader starts its epoch from the beginning)"
    if name == "scaler.pt":
        return (
            "the AMP gradient scaler state (scaler.pt) is not carried over: a resumed fp16 run starts with a fresh "
            "scale"
        )
    if re.fullmatch(r"custom_checkpoint_[0-9]+\.pkl", name):
        return f"not carried over: {name} (an object registered with accelerator.register_for_checkpointing)"
    kind = "a directory (FSDP or DeepSpeed shards are not imported)" if is_dir else "not a file save_state writes"
    return f"not carried over: {name} ({kind})"


def _accelerate_rng(path: Path) -> tuple[dict[str, Any], int | None]:
    """torchrig's RNG record from one process's ``random_states_N.pkl``, and the step it records."""
    states = _torch_file(path, "an Accelerate RNG state file", _NUMPY_ARRAY_GLOBALS)
    try:
        py, npy, cpu = states["random_state"], states["numpy_random_seed"], states["torch_manual_seed"]
        key = np.asarray(npy[1])
        if npy[0] != "MT19937" or key.shape != (624,) or not isinstance(cpu, torch.Tensor):
            raise ValueError("not the states of random, numpy and torch")
        rng: dict[str, Any] = {
            "python": py,
            "numpy": {
                "key": torch.from_numpy(key.astype(np.int64)),
                "pos": int(npy[2]),
                "has_gauss": int(npy[3]),
                "cached_gaussian": float(npy[4]),
            },
            "torch": cpu,
        }
        for name, value in states.items():
            found = re.fullmatch(r"torch_(\w+)_manual_seed", str(name))
            if found and isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
                rng["device_type"], rng["device"] = found[1], value
        random.Random().setstate(py)  # a malformed state fails here, not at the resume
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path} is not an Accelerate RNG state file ({type(err).__name__}: {err})") from None
    step = states.get("step")
    return rng, step if isinstance(step, int) and not isinstance(step, bool) else None


def _seeded_rng(seed: int) -> dict[str, Any]:
    """The RNG record of a process right after seeding random, numpy and torch with ``seed`` (none is touched)."""
    np_state: Any = np.random.RandomState(seed).get_state()
    return {
        "python": random.Random(seed).getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.Generator().manual_seed(seed).get_state(),
    }


# -- the torchrig checkpoint ---------------------------------------------------------------------
def _check_target(target: Path) -> None:
    if target.is_symlink() or (target.exists() and not (target.is_dir() and (target / META).is_file())):
        raise CheckpointError(
            f"{target} exists and is not a torchrig checkpoint; give a new path (an existing torchrig checkpoint "
            "there is replaced atomically)"
        )


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


def _payload(peer: _Peer, optimizers: list[str], schedulers: list[str]) -> dict[str, Any]:
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
        name, how = _optimizer_class(sd, optimizers[i] if i < len(optimizers) else None, f"optimizer {n}")
        objects[f"optimizer_{n}"] = sd
        entries[f"optimizer_{n}"] = {"kind": "state", "type": name}
        peer.lines.append(f"optimizer_{n}: {name} ({how})")
    for i, (n, sd) in enumerate(sorted(peer.schedulers.items())):
        name, how = _scheduler_class(sd, schedulers[i] if i < len(schedulers) else None, f"scheduler {n}")
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
    values = {"callbacks": {}, **peer.values, "step": peer.step, "epoch": peer.epoch}
    entries.update({k: {"kind": "value", "type": f"builtins.{type(v).__name__}"} for k, v in values.items()})
    peer.lines.append(f"step {peer.step}, epoch {peer.epoch}")
    blob = {"objects": objects, "values": values, "module_extras": extras, "rng": peer.rng}
    return {"modules": modules, "blob": blob, "entries": entries, "counts": {"parameters": floats}}


def _names(sd: dict[str, Any]) -> str:
    names = list(sd)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _given_class(given: str, base: type, flag: str) -> str:
    module, _, attr = given.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except ImportError as err:
        raise ValueError(f"{flag} {given!r}: cannot import {module} ({err})") from None
    except AttributeError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{flag} {given!r} is not a {class_name(base)} class; give one such as {_example(base)}")
    return class_name(cls)


def _example(base: type) -> str:
    return "torch.optim.AdamW" if base is torch.optim.Optimizer else "torch.optim.lr_scheduler.StepLR"


def _optimizer_class(sd: Any, given: str | None, where: str) -> tuple[str, str]:
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    if not (
        isinstance(groups, list)
        and groups
        and isinstance(sd.get("state"), dict)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise CheckpointError(f"{where} is not an optimizer state dict (it needs 'state' and 'param_groups')")
    if given is not None:
        return _given_class(given, torch.optim.Optimizer, "--optimizer"), "as --optimizer names it"
    saved = groups[0]
    keys = frozenset(k for k in saved if k not in ("params", "initial_lr"))
    found = {name: d for name, d in _optimizer_defaults() if frozenset(d) == keys}
    if len(found) > 1:  # Adam and AdamW: the same fields, told apart by a flag's value
        flags = [k for k in keys if all(isinstance(d[k], bool) for d in found.values())]
        flags = [k for k in flags if len({d[k] for d in found.values()}) > 1]
        found = {n: d for n, d in found.items() if all(d[k] == saved.get(k) for k in flags)}
    if len(found) != 1:
        which = f"it could be {' or '.join(sorted(found))}" if found else "no torch.optim class has these fields"
        raise ValueError(
            f"cannot tell the class of {where} from its parameter-group fields ({', '.join(sorted(keys))}): {which}; "
            "name it with --optimizer, e.g. --optimizer torch.optim.AdamW"
        )
    return next(iter(found)), "inferred from its parameter-group fields; --optimizer names another"


@functools.cache
def _optimizer_defaults() -> tuple[tuple[str, dict[str, Any]], ...]:
    """The parameter-group fields of each torch optimizer made with its defaults."""
    out = []
    for name in torch.optim.__all__:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                make: Any = cls  # each with its own signature; the defaults are what is wanted
                group = make([torch.zeros(2, 2, requires_grad=True)]).param_groups[0]
        except Exception:  # an optimizer that needs arguments: name it with --optimizer
            continue
        out.append((class_name(cls), {k: v for k, v in group.items() if k != "params"}))
    return tuple(out)


def _scheduler_class(sd: Any, given: str | None, where: str) -> tuple[str, str]:
    if not isinstance(sd, dict):
        raise CheckpointError(f"{where} is a {type(sd).__name__}, not an LR scheduler state dict")
    if given is not None:
        return _given_class(given, lr_scheduler.LRScheduler, "--scheduler"), "as --scheduler names it"
    own = frozenset(map(str, sd)) - _scheduler_base_fields()
    found = []
    for name in dir(lr_scheduler):
        cls = getattr(lr_scheduler, name)
        if name.startswith("_") or not isinstance(cls, type) or not issubclass(cls, lr_scheduler.LRScheduler):
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        args = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if args - {"self", "optimizer", "last_epoch", "verbose"} == own:
            found.append(class_name(cls))
    if len(found) != 1:
        which = f"it could be {' or '.join(found)}" if found else "no torch.optim.lr_scheduler class has these fields"
        raise ValueError(
            f"cannot tell the class of {where} from its fields ({', '.join(sorted(own))}): {which}; name it with "
            "--scheduler, e.g. --scheduler torch.optim.lr_scheduler.StepLR"
        )
    return found[0], "inferred from its fields; --scheduler names another"


@functools.cache
def _scheduler_base_fields() -> frozenset[str]:
    """The fields every torch LR scheduler's state has (those of a StepLR but its own two)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return frozenset(lr_scheduler.StepLR(optimizer, 1).state_dict()) - {"step_size", "gamma"}
