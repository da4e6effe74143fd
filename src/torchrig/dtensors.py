"""DTensors (the parameters FSDP2 and tensor parallel make, and the values computed from them)
where torchrig needs plain tensors: the process-group collectives and the foreach kernels refuse
them, or refuse to mix them with plain tensors."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch


def _dtensor_type() -> type | None:
    """``DTensor``, or None when nothing has imported it yet: then no DTensor exists, and
    importing it would cost a run without any a second."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (without importing DTensor where nothing has)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor: a DTensor becomes the full tensor it stands for (a collective
    over its mesh, so every rank of that mesh calls it; differentiable)."""
    if is_dtensor(tensor):
        return tensor.full_tensor()  # type: ignore[attr-defined,no-any-return]
    return tensor


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor, a DTensor as this rank's shard (its storage: changing it in place changes the
    DTensor), so that one ``torch._foreach_*`` call can take DTensors of any mesh and plain tensors."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(tensors)
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]  # type: ignore[attr-defined]
