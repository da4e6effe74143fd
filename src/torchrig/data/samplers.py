"""Index orders for prepared loaders: a shuffle that depends only on ``(seed, epoch)``, and the
rest of an epoch's batch order after a resume, skipped at the index level."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sized
from itertools import islice
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler


class ResumableSampler(Sampler[int]):
    """A permutation per ``(seed, epoch)``, split across ``num_replicas`` ranks.

    With a ``generator`` (the one a user gave their ``RandomSampler`` or ``DataLoader``), each
    epoch's permutation is drawn from it instead, as torch's ``RandomSampler`` draws it (its state
    advancing epoch after epoch, ``seed`` unused); the loader saves the generator's state at the
    start of each epoch, so a resume draws the same permutation again.

    With ``num_replicas=R`` rank ``r`` takes every R-th index starting at ``r``, so the
    per-rank batches of one step together hold the same samples as the single-process batch
    of ``R`` times the size (the dataset is padded by repeating indices when it does not split
    evenly, unless ``drop_last``). Its length is always the whole epoch's; a resumed epoch
    skips inside it through :class:`ResumedIndices`.
    """

    def __init__(
        self,
        data_source: Sized,
        *,
        shuffle: bool,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        self.data_source = data_source
        self.shuffle = shuffle
        self.generator = generator
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        n = len(data_source)
        if drop_last and n % num_replicas:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        n = len(self.data_source)
        if self.shuffle and self.generator is not None:  # torch's own sampler draws it: the same order
            order = list(RandomSampler(self.data_source, generator=self.generator))
        elif self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.total_size > n:
            order += (order * math.ceil(self.total_size / n))[: self.total_size - n]
        order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_samples


def _skipped(index_sampler: Iterable[Any], skip: int) -> Iterator[Any]:
    """``iter(index_sampler)`` after its first ``skip`` items, skipped without a Python step each.

    torch's own ``BatchSampler`` skips ``skip x batch_size`` indices of its sampler instead of
    building the skipped batches (the cost of a resume then hardly grows with how far into the
    epoch it is), and batches the rest as it would (``drop_last`` included)."""
    if type(index_sampler) is BatchSampler:
        indices = iter(index_sampler.sampler)
        deque(islice(indices, skip * index_sampler.batch_size), maxlen=0)
        return _batched(indices, index_sampler.batch_size, index_sampler.drop_last)
    it = iter(index_sampler)
    deque(islice(it, skip), maxlen=0)
    return it


def _batched(indices: Iterator[int], size: int, drop_last: bool) -> Iterator[list[int]]:
    """Lists of ``size`` indices, as ``BatchSampler`` makes them (a shorter last one unless ``drop_last``)."""
    while batch := list(islice(indices, size)):
        if len(batch) < size and drop_last:
            return
        yield batch


class ResumedIndices:
    """The rest of an epoch of ``index_sampler`` (a batch sampler, or a sampler without
    batching) after its first ``skip`` items: skipped as indices, no sample is read for them.

    :meth:`start` draws the epoch's order (a sampler drawing from torch's RNG draws then) and
    skips; the loader calls it right after it starts the epoch's DataLoader iterator, while the
    RNG holds the epoch's state. Every ``iter()`` continues the same started order, as a
    DataLoader may call ``iter()`` on its index sampler more than once per epoch."""

    def __init__(self, index_sampler: Iterable[Any], skip: int) -> None:
        self.index_sampler = index_sampler
        self.skip = skip
        self._it: Iterator[Any] | None = None

    def start(self) -> None:
        if self._it is None:
            self._it = _skipped(self.index_sampler, self.skip)

    def __iter__(self) -> Iterator[Any]:
        # Lazy, as a sampler's own iterator is: the DataLoader calls iter() before it draws the
        # workers' seed, and a sampler draws its order only at the first next(), after that seed.
        self.start()
        assert self._it is not None
        yield from self._it

    def __len__(self) -> int:
        return max(len(self.index_sampler) - self.skip, 0)  # type: ignore[arg-type]
