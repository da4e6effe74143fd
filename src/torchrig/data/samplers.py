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


class _Skipping:
    """One iteration of ``index_sampler`` after its first ``skip`` items, skipped without a Python
    step each at :meth:`start` (or the first ``next()``).

    Made when the DataLoader calls ``iter()`` on its index sampler, it calls ``iter(index_sampler)``
    right then, as the DataLoader would: a sampler that draws its order in ``__iter__`` itself (a
    bucketing batch sampler's ``randperm`` before it returns ``iter(batches)``) draws it at the
    moment it did when the epoch first ran, before the workers' seed; one whose ``__iter__`` is a
    generator draws at the first item. torch's own ``BatchSampler`` (a generator, which calls
    ``iter()`` on its sampler at its first item) skips ``skip x batch_size`` indices of its sampler
    instead of building the skipped batches (the cost of a resume then hardly grows with how far
    into the epoch it is), and batches the rest as it would (``drop_last`` included)."""

    def __init__(self, index_sampler: Iterable[Any], skip: int) -> None:
        self.index_sampler, self.skip = index_sampler, skip
        self._by_index = type(index_sampler) is BatchSampler
        self._items: Iterator[Any] | None = None if self._by_index else iter(index_sampler)
        self._rest: Iterator[Any] | None = None

    def start(self) -> None:
        if self._rest is not None:
            return
        if isinstance(self.index_sampler, BatchSampler) and self._by_index:
            indices = iter(self.index_sampler.sampler)
            deque(islice(indices, self.skip * self.index_sampler.batch_size), maxlen=0)
            self._rest = _batched(indices, self.index_sampler.batch_size, self.index_sampler.drop_last)
        else:
            assert self._items is not None
            deque(islice(self._items, self.skip), maxlen=0)
            self._rest = self._items

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.start()
        assert self._rest is not None
        return next(self._rest)


def _batched(indices: Iterator[int], size: int, drop_last: bool) -> Iterator[list[int]]:
    """Lists of ``size`` indices, as ``BatchSampler`` makes them (a shorter last one unless ``drop_last``)."""
    while batch := list(islice(indices, size)):
        if len(batch) < size and drop_last:
            return
        yield batch


class ResumedIndices:
    """The rest of an epoch of ``index_sampler`` (a batch sampler, or a sampler without
    batching) after its first ``skip`` items: skipped as indices, no sample is read for them.

    Each ``iter()`` (a DataLoader calls it once or twice an epoch, as it calls it on its own index
    sampler) iterates ``index_sampler`` anew from its start, at the moment the DataLoader would
    (:class:`_Skipping`), so a sampler drawing its order from torch's RNG draws it as the epoch
    first did. :meth:`start` skips in the latest iteration (making one when there is none yet,
    which the next ``iter()`` then gives out): the loader calls it right after it starts the
    epoch's DataLoader iterator, while the RNG holds the epoch's state, so a sampler drawing at
    its first item draws then, not at the first batch the loop asks for."""

    def __init__(self, index_sampler: Iterable[Any], skip: int) -> None:
        self.index_sampler = index_sampler
        self.skip = skip
        self._it: _Skipping | None = None
        self._unclaimed = False  # started by start() before any iter(): the next iter() takes it

    def start(self) -> None:
        if self._it is None:
            self._it, self._unclaimed = _Skipping(self.index_sampler, self.skip), True
        self._it.start()

    def __iter__(self) -> Iterator[Any]:
        if not self._unclaimed:
            self._it = _Skipping(self.index_sampler, self.skip)
        self._unclaimed = False
        assert self._it is not None
        return self._it

    def __len__(self) -> int:
        return max(len(self.index_sampler) - self.skip, 0)  # type: ignore[arg-type]
