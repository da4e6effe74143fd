"""Rebuilding a user's DataLoader as ``prepare`` runs it: with a
:class:`~torchrig.data.samplers.ResumableSampler` in place of a random or sequential one, keeping
every other argument it was built with."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from torchrig.data.samplers import ResumableSampler


def loader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """The keyword arguments ``loader`` was built with, other than its dataset, batching and
    sampling (workers, collate_fn, pinning...): what a rebuilt copy of it passes on."""
    kw: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kw["pin_memory_device"] = loader.pin_memory_device
    return kw


def order_sampler(loader: DataLoader[Any]) -> Any:
    """The sampler that orders ``loader``'s indices: the sampler of its batch sampler when that is
    torch's own ``BatchSampler`` (``DataLoader(batch_sampler=BatchSampler(WeightedRandomSampler(...),
    ...))``, where ``loader.sampler`` is a ``SequentialSampler`` the batches never use), else
    ``loader.sampler``."""
    batches = loader.batch_sampler
    return batches.sampler if type(batches) is BatchSampler else loader.sampler


def sampler_generator(loader: DataLoader[Any]) -> torch.Generator | None:
    """The generator ``loader``'s ``RandomSampler`` draws its order from (``DataLoader(shuffle=True,
    generator=g)`` gives it ``g``), which its rebuilt :class:`ResumableSampler` honours; None for
    any other sampler, or one without a generator (its order then comes from the run's seed)."""
    sampler = order_sampler(loader)
    return sampler.generator if type(sampler) is RandomSampler else None


def rebuild_with_sampler(
    loader: DataLoader[Any], *, seed: int, num_replicas: int, rank: int, pin_memory: bool
) -> DataLoader[Any] | None:
    """The same loader with a :class:`ResumableSampler` in place of its :func:`order_sampler`, a
    ``RandomSampler`` (without replacement or ``num_samples``) or ``SequentialSampler`` of torch's
    own over the whole dataset, batched by torch's ``BatchSampler``; None when it cannot be rebuilt.

    Any other order (a custom batch sampler or sampler, a subclass of torch's, an iterable
    dataset) is left alone: it is theirs to control.
    """
    bs, order = loader.batch_sampler, order_sampler(loader)
    if type(bs) is not BatchSampler or type(order) not in (RandomSampler, SequentialSampler):
        return None
    if isinstance(order, RandomSampler) and (order.replacement or order._num_samples is not None):
        return None
    if len(order) != len(loader.dataset):  # type: ignore[arg-type]  # (a sampler over a part of it)
        return None
    sampler = ResumableSampler(
        loader.dataset,  # type: ignore[arg-type]
        shuffle=isinstance(order, RandomSampler),
        seed=seed,
        num_replicas=num_replicas,
        rank=rank,
        drop_last=bs.drop_last,
        generator=sampler_generator(loader),
    )
    kw = loader_kwargs(loader)
    kw["pin_memory"] = kw["pin_memory"] or pin_memory
    return DataLoader(loader.dataset, batch_size=bs.batch_size, sampler=sampler, drop_last=bs.drop_last, **kw)
