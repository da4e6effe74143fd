"""Reading the directory Accelerate's ``save_state`` wrote into a
:class:`~torchrig.checkpoint.peers.sources.Peer`."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.peers.sources import NUMPY_ARRAY_GLOBALS, Peer, safetensors_file, seeded_rng, torch_file

_ACCELERATE = re.compile(
    r"(?P<kind>model|pytorch_model|optimizer|scheduler)(?:_(?P<n>[0-9]+))?\.(?P<ext>safetensors|bin)"
    r"|random_states_(?P<rank>[0-9]+)\.pkl"
)


def read_accelerate(folder: Path, seed: int) -> Peer:
    names = sorted(p.name for p in folder.iterdir())
    peer = Peer("Accelerate", {})
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
            sd = safetensors_file(p) if m["ext"] == "safetensors" else torch_file(p, "a saved model state")
            if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
                raise CheckpointError(f"{p} is not a model state dict (names to tensors)")
            peer.modules["module" if n == 0 else f"module_{n}"] = sd
        elif m["ext"] == "bin":
            store = peer.optimizers if kind == "optimizer" else peer.schedulers
            store[n] = torch_file(p, f"an Accelerate {kind} state")
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
        peer.rng = [seeded_rng(seed)]
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
    states = torch_file(path, "an Accelerate RNG state file", NUMPY_ARRAY_GLOBALS)
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
