"""What the peer readers share: :class:`Peer`, the record of another library's checkpoint as
read, and reading its files without running anything they hold."""

from __future__ import annotations

import io
import random
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.reading import read_regular, safe_torch_load

# What numpy needs to rebuild the arrays of Accelerate's RNG file: an array of a plain dtype.
NUMPY_ARRAY_GLOBALS = {
    "numpy.dtype", "numpy.ndarray", "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType", "numpy.dtypes.Int64DType", "numpy.dtypes.Float64DType",
}  # fmt: skip


@dataclass
class Peer:
    """Another library's checkpoint as a reader found it: the module state dicts by entry name,
    the optimizer and scheduler states by index, where the fit stood, the RNG states per rank,
    other values to store, and the lines and warnings the import reports."""

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


def torch_file(path: Path, what: str, allowed: set[str] | frozenset[str] = frozenset()) -> Any:
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
        with torch.serialization.safe_globals(numpy_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"could not read {path} ({what}): {type(err).__name__}: {err}") from None


def numpy_globals() -> list[Any]:
    """The objects of :data:`NUMPY_ARRAY_GLOBALS` (NumPy 1 named its module ``numpy.core``)."""
    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)]
    return [np.dtype, np.ndarray, reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), *dtypes]


def safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return dict(safetensors.torch.load(read_regular(path)))
    except Exception as err:
        raise CheckpointError(f"could not read {path} as safetensors: {type(err).__name__}: {err}") from None


def seeded_rng(seed: int) -> dict[str, Any]:
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
