"""RNG states of a run: Python, NumPy, torch CPU and every device, captured as weights_only-safe data."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from torchrig.devices import device_module


def capture_rng(device: torch.device) -> dict[str, Any]:
    """Python, NumPy, torch CPU and every device of ``device.type``, as weights_only-safe data."""
    np_state: Any = np.random.get_state()  # the legacy tuple form
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    mod = _device_module(device)
    if mod is not None:
        rng["device_type"] = device.type
        rng["device"] = [s.cpu() for s in mod.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_tuple(rng["python"]))
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(rng["torch"].cpu())
    mod = _device_module(device)
    if mod is not None and rng.get("device_type") == device.type:
        states = rng["device"]
        if len(states) == mod.device_count():
            mod.set_rng_state_all(states)
        else:  # a different number of devices: this process's device gets the first saved state
            mod.set_rng_state(states[0], device.index)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _device_module(device: torch.device) -> Any:
    if device.type in ("cpu", "meta"):
        return None
    mod = device_module(device.type)
    return mod if hasattr(mod, "get_rng_state_all") and hasattr(mod, "set_rng_state_all") else None
