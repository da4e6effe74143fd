"""``Rig.gather_for_metrics``: gather a batch from every rank, in dataset order, without padding.

A distributed sampler gives every rank the same number of samples, so when the dataset does not
split evenly it repeats the first few indices at the end of the epoch. Metrics computed over
those duplicates are wrong; this removes them.

With :class:`~torchrig.data.ResumableSampler`, rank ``r`` takes global positions ``r, r+R, ...``.
So interleaving the gathered per-rank batches (``(R, B, ...) -> (B*R, ...)``) restores the global
order, and the duplicates are the last ``total_size - len(dataset)`` rows of the epoch's last batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchrig.data import ResumableSampler
from torchrig.nested import is_container, rebuild

if TYPE_CHECKING:
    from torchrig.rig import Rig


def _padding_of_current_batch(rig: Rig, batch_size: int) -> int:
    """How many padded rows the batch being gathered holds: non-zero only on a padded last batch.

    The batch is the one :attr:`Rig.current_loader <torchrig.Rig.current_loader>` (the prepared
    loader that yielded most recently) has just given out: its padding counts when that was the
    epoch's last batch, the sampler pads, and the gathered tensor has the last batch's number of rows.
    """
    loader = rig.current_loader
    if loader is None:
        return 0
    sampler = getattr(loader.loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler):
        return 0
    pad, steps = sampler.total_size - len(sampler.data_source), len(loader)
    if pad <= 0 or steps == 0 or loader.batches_seen != steps:
        return 0
    per_rank = loader.loader.batch_size or 1
    last = sampler.num_samples - (steps - 1) * per_rank
    return pad if last == batch_size else 0


def _is_object_batch(obj: Any) -> bool:
    """A plain list or tuple of plain objects (ids, strings, numbers): one per sample, a batch."""
    return type(obj) in (list, tuple) and not any(isinstance(v, torch.Tensor) or is_container(v) for v in obj)


def _walk(obj: Any, on_tensor: Callable[[torch.Tensor], Any], on_objects: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``on_tensor`` applied to each tensor and ``on_objects`` to each other
    leaf (a batch of plain objects counts as one leaf), always in the same order."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if obj is None:  # nothing to gather (a predict_step that returns None)
        return None
    if _is_object_batch(obj) or not is_container(obj):
        return on_objects(obj)
    return rebuild(obj, lambda v: _walk(v, on_tensor, on_objects))


def _interleave(per_rank: list[Sequence[Any]]) -> list[Any]:
    """Rank ``r``'s ``i``-th item at ``i * R + r``: the order the gathered tensors get."""
    longest = max(len(items) for items in per_rank)
    return [items[i] for i in range(longest) for items in per_rank if i < len(items)]


def gather_for_metrics(rig: Rig, obj: Any) -> Any:
    """Every rank's ``obj`` (tensors, objects, or nested collections of them) as one batch, duplicates dropped.

    Tensors need a batch dimension and the same shape on every rank; 0-dim tensors become a
    ``(world_size,)`` vector. A plain list or tuple of objects (ids, file names, strings) is a batch
    too: it is gathered in the same order as the tensors and loses the same padded duplicates, so
    ``zip(out["id"], out["pred"])`` pairs every sample correctly. Tensor- and pipeline-parallel
    peers share their batches, so a batch is taken once per data-parallel rank. ``None`` stays ``None``; any other
    object becomes a list of every rank's value, in rank order (as a 0-dim tensor does). In a single process ``obj``
    comes back unchanged.

    Example:
        >>> # preds, targets = rig.gather_for_metrics((model(x).argmax(-1), y))
    """
    world = rig.world_size
    if world == 1:
        return obj
    # Tensor- and pipeline-parallel peers hold the same batch: a batch is taken from one of each
    sources = rig.strategy.data_parallel_sources() if rig.strategy.data_parallel_size != world else None

    def gather(t: torch.Tensor) -> torch.Tensor:
        stacked = rig.strategy.all_gather(t)  # (world, batch, ...)
        if t.dim() == 0:
            return stacked
        if sources is not None:
            stacked = stacked[sources]
        merged = stacked.transpose(0, 1).reshape(-1, *t.shape[1:])
        pad = _padding_of_current_batch(rig, t.shape[0])
        return merged[: merged.shape[0] - pad] if pad else merged

    objects: list[Any] = []
    _walk(obj, lambda t: t, lambda o: objects.append(o))
    merged: list[Any] = []
    if objects:  # one collective for every object leaf
        per_rank = rig.strategy.all_gather_object(objects)
        for i, mine in enumerate(objects):
            values = [rank_objects[i] for rank_objects in per_rank]
            if _is_object_batch(mine):
                items = _interleave(values if sources is None else [values[r] for r in sources])
                pad = _padding_of_current_batch(rig, len(mine))
                items = items[: len(items) - pad] if pad else items
                merged.append(type(mine)(items))
            else:
                merged.append(values)
    leaves = iter(merged)
    return _walk(obj, gather, lambda _: next(leaves))
