"""``gather_for_metrics``: gather a batch from every rank, in dataset order, without padding.

A distributed sampler gives every rank the same number of samples, so when the dataset does not
split evenly it repeats the first few indices at the end of the epoch. Metrics computed over
those duplicates are wrong; this removes them.

With :class:`~torchrig.data.ResumableSampler`, rank ``r`` takes global positions ``r, r+R, ...``.
So interleaving the gathered per-rank batches (``(R, B, ...) -> (B*R, ...)``) restores the global
order, and the duplicates are the last ``total_size - len(dataset)`` rows of the epoch's last batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchrig.collections import apply_to_tensors
from torchrig.data import ResumableSampler

if TYPE_CHECKING:
    from torchrig.rig import Rig


def _padding_of_current_batch(rig: Rig, batch_size: int) -> int:
    """How many padded rows the batch being gathered holds: non-zero only on a padded last batch.

    The batch is the one the prepared loader that yielded most recently has just given out
    (``RigDataLoader.yielded_at``): its padding counts when that was the epoch's last batch, the
    sampler pads, and the gathered tensor has the last batch's number of rows.
    """
    if not rig._loaders:
        return 0
    loader = max(rig._loaders, key=lambda candidate: candidate.yielded_at)
    sampler = getattr(loader.loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler) or loader.yielded_at < 0:
        return 0
    pad, steps = sampler.total_size - len(sampler.data_source), len(loader)
    if pad <= 0 or steps == 0 or loader.batches_seen != steps:
        return 0
    per_rank = loader.loader.batch_size or 1
    last = sampler.num_samples - (steps - 1) * per_rank
    return pad if last == batch_size else 0


def gather_for_metrics(rig: Rig, obj: Any) -> Any:
    """Every rank's ``obj`` (tensors, or nested collections of them) as one batch, duplicates dropped.

    Tensors need a batch dimension and the same shape on every rank; 0-dim tensors become a
    ``(world_size,)`` vector. In a single process ``obj`` comes back unchanged.

    Example:
        >>> # preds, targets = rig.gather_for_metrics((model(x).argmax(-1), y))
    """
    world = rig.world_size
    if world == 1:
        return obj

    def gather(t: torch.Tensor) -> torch.Tensor:
        stacked = rig.strategy.all_gather(t)  # (world, batch, ...)
        if t.dim() == 0:
            return stacked
        merged = stacked.transpose(0, 1).reshape(-1, *t.shape[1:])
        pad = _padding_of_current_batch(rig, t.shape[0])
        return merged[: merged.shape[0] - pad] if pad else merged

    return apply_to_tensors(obj, gather)
