"""``ResumedIndices``: the rest of an epoch's order after ``skip`` batches, equal to the batches
the batch sampler itself makes from there (torch's ``BatchSampler`` is skipped by indices, any
other batch sampler item by item)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from torchrig.data.samplers import ResumedIndices


class Pairs(Sampler[list[int]]):
    """A batch sampler of another class (not torch's BatchSampler): pairs of neighbours."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[i, i + 1] for i in range(0, self.n - 1, 2)])

    def __len__(self) -> int:
        return self.n // 2


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 7),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    skip=st.integers(0, 45),
)
def test_the_batches_after_a_skip_are_the_batch_samplers_own(
    n: int, batch_size: int, drop_last: bool, shuffle: bool, skip: int
) -> None:
    def sampler() -> Sampler[int]:
        if shuffle:
            return RandomSampler(range(n), generator=torch.Generator().manual_seed(n))
        return SequentialSampler(range(n))

    whole = list(BatchSampler(sampler(), batch_size, drop_last))
    resumed = ResumedIndices(BatchSampler(sampler(), batch_size, drop_last), skip)
    resumed.start()
    assert list(resumed) == whole[skip:]
    assert len(resumed) == max(len(whole) - skip, 0)


def test_another_batch_samplers_items_are_skipped_one_by_one() -> None:
    resumed = ResumedIndices(Pairs(9), 2)
    resumed.start()
    assert list(resumed) == [[4, 5], [6, 7]]


def test_a_random_order_is_drawn_from_the_rng_as_the_epoch_first_drew_it() -> None:
    torch.manual_seed(3)
    whole = list(BatchSampler(RandomSampler(range(50)), 4, False))
    torch.manual_seed(3)
    resumed = ResumedIndices(BatchSampler(RandomSampler(range(50)), 4, False), 5)
    resumed.start()
    assert list(resumed) == whole[5:]
