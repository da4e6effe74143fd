"""Reading a Lightning ``.ckpt`` file into a :class:`~torchrig.checkpoint.peers.sources.Peer`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.peers.sources import Peer, seeded_rng, torch_file
from torchrig.trainer.hparams import HPARAMS_KEY, check_plain

_SCALER_KEYS = ("MixedPrecision", "native_amp_scaling_state", "MixedPrecisionPlugin")
_LIGHTNING_KNOWN = {
    "epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
    "optimizer_states", "lr_schedulers", "hyper_parameters", "hparams_name", "hparams_type",
}  # fmt: skip


def read_lightning(path: Path, seed: int) -> Peer:
    ck = torch_file(path, "a Lightning checkpoint")
    if not isinstance(ck, dict) or not isinstance(ck.get("state_dict"), dict):
        has = sorted(map(str, ck))[:8] if isinstance(ck, dict) else type(ck).__name__
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it has no 'state_dict' dict (it holds {has})")
    version = ck.get("pytorch-lightning_version")
    peer = Peer(f"Lightning {version}" if isinstance(version, str) else "Lightning", {"module": ck["state_dict"]})
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
    peer.rng = [seeded_rng(seed)]
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


def _lightning_position(peer: Peer, loops: Any) -> None:
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


def _take_hparams(peer: Peer, hparams: Any) -> None:
    try:
        if not isinstance(hparams, dict):
            raise ValueError(f"it is a {type(hparams).__name__}, not a dict")
        check_plain(hparams, "hyper_parameters")
    except ValueError as err:
        peer.warnings.append(f"hyper_parameters are not carried over: {err}")
        return
    peer.values[HPARAMS_KEY] = dict(hparams)
    peer.lines.append(f"{HPARAMS_KEY}: Lightning's hyper_parameters ({', '.join(map(str, hparams)) or 'none'})")
