"""Samplers and batch samplers users build themselves, in prepared loaders: the order they give is
theirs (also inside torch's ``BatchSampler``), and a run stopped after any batch of two epochs and
resumed, once or twice, gives the uninterrupted run's batches: a sampler drawing from its own
``torch.Generator``, a batch sampler drawing its order in ``__iter__``, with 0 and 2 workers."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import torchrig
from torchrig.data import RigDataLoader

pytestmark = pytest.mark.timeout(120)

_spec = importlib.util.spec_from_file_location(
    "data_position", Path(__file__).resolve().parent / "test_data_position.py"
)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
N, BATCH, Items = harness.N, harness.BATCH, harness.Items


@dataclasses.dataclass
class Batch:
    id: torch.Tensor


def _ids(batch: Any) -> list[int]:
    """The sample ids of a batch: a tensor, a mapping's ``id`` (a dict, a ``BatchEncoding``), a dataclass's."""
    if isinstance(batch, Batch):
        batch = batch.id
    elif not isinstance(batch, torch.Tensor):
        batch = batch["id"]
    return batch.flatten().tolist()  # type: ignore[no-any-return]


harness.ids = _ids  # (this module's own copy of the harness)


def _to_dataclass(items: list[torch.Tensor]) -> Batch:
    return Batch(torch.stack(items))


def _to_batch_encoding(items: list[torch.Tensor]) -> Any:
    from transformers import BatchEncoding

    return BatchEncoding({"id": torch.stack(items)})


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(5)


class Buckets(Sampler[list[int]]):
    """A bucketing batch sampler: batches of neighbouring lengths in a random order, drawn from
    torch's RNG in ``__iter__`` itself (not a generator function: the draw happens at ``iter()``)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self) -> Iterator[list[int]]:
        by_length = torch.randperm(self.n).tolist()
        batches = [sorted(by_length[i : i + self.size]) for i in range(0, self.n, self.size)]
        return iter([batches[i] for i in torch.randperm(len(batches)).tolist()])

    def __len__(self) -> int:
        return math.ceil(self.n / self.size)


class LazyBuckets(Buckets):
    """:class:`Buckets` whose ``__iter__`` is a generator function: it draws at its first batch."""

    def __iter__(self) -> Iterator[list[int]]:
        yield from super().__iter__()


_WEIGHTS = torch.linspace(0.1, 1, N)

#: name -> the DataLoader (given its number of workers); each is built anew per process, its
#: generator seeded afresh, as a resumed script builds it.
KINDS: dict[str, Callable[[int], DataLoader[Any]]] = {
    "weighted_generator": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=WeightedRandomSampler(_WEIGHTS, N, generator=_g()), num_workers=w
    ),
    "subset_generator": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=SubsetRandomSampler(range(N), generator=_g()), num_workers=w
    ),
    "replacement_generator": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=RandomSampler(Items(), replacement=True, generator=_g()), num_workers=w
    ),
    "batch_sampler_weighted_generator": lambda w: DataLoader(
        Items(),
        batch_sampler=BatchSampler(WeightedRandomSampler(_WEIGHTS, N, generator=_g()), BATCH, False),
        num_workers=w,
    ),
    "shuffle_generator": lambda w: DataLoader(Items(), batch_size=BATCH, shuffle=True, generator=_g(), num_workers=w),
    "buckets": lambda w: DataLoader(Items(), batch_sampler=Buckets(N, BATCH), num_workers=w),
    # torch draws no base seed when a persistent iterator starts its next epoch: a resumed run neither
    "persistent_workers_weighted": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=WeightedRandomSampler(_WEIGHTS, N), num_workers=w, persistent_workers=w > 0
    ),
    "persistent_workers_lazy_buckets": lambda w: DataLoader(
        Items(), batch_sampler=LazyBuckets(N, BATCH), num_workers=w, persistent_workers=w > 0
    ),
    "random_num_samples": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=RandomSampler(Items(), num_samples=20), num_workers=w
    ),
    "users_distributed_sampler": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=DistributedSampler(Items(), num_replicas=1, rank=0, seed=3), num_workers=w
    ),
    "batch_size_none": lambda w: DataLoader(Items(), batch_size=None, shuffle=True, num_workers=w),
    "short_last_batch": lambda w: DataLoader(
        Subset(Items(), range(N - 2)), batch_size=BATCH, shuffle=True, num_workers=w
    ),
    "drop_last": lambda w: DataLoader(
        Subset(Items(), range(N + 2)), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=w
    ),
    "dataclass_batches": lambda w: DataLoader(
        Items(), batch_size=BATCH, shuffle=True, collate_fn=_to_dataclass, num_workers=w
    ),
    "batch_encoding_batches": lambda w: DataLoader(
        Items(), batch_size=BATCH, shuffle=True, collate_fn=_to_batch_encoding, num_workers=w
    ),
}


def _prepared(loader: DataLoader[Any]) -> RigDataLoader:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.seed_everything(0)
    return rig.prepare(loader)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stopped_after_any_batch_and_resumed_once_or_twice_a_run_gives_the_uninterrupted_batches(kind: str) -> None:
    # Without workers: a stop after every batch of two epochs (the first, the last, each epoch's
    # end), resumed once, and resumed twice (the second stop one batch later).
    def make() -> RigDataLoader:
        return _prepared(KINDS[kind](0))

    whole = harness.whole_run(make)
    batches = len(whole)  # two epochs
    wrong = [
        stops
        for k in range(1, batches + 1)
        for stops in ([k], [k, 1])
        if harness.run_in_pieces(make, stops, end_workers=False)[0] != whole
    ]
    assert wrong == []


# (persistent workers outlive each loader of the run in pieces: their shutdown takes seconds)
@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k.startswith("persistent") else k for k in sorted(KINDS)]
)
def test_with_workers_stopped_in_each_epoch_and_at_its_end_a_run_gives_the_uninterrupted_batches(kind: str) -> None:
    def make() -> RigDataLoader:
        return _prepared(KINDS[kind](2))

    whole = harness.whole_run(make)
    per_epoch = len(whole) // 2
    for stops in ([1], [per_epoch], [per_epoch + 2, 1]):  # the first batch, the epoch's end, twice in the next
        assert harness.run_in_pieces(make, stops, end_workers=True)[0] == whole, stops


def test_the_sampler_of_torchs_batch_sampler_orders_the_prepared_loader() -> None:
    # DataLoader(batch_sampler=BatchSampler(sampler, ...)) leaves loader.sampler a SequentialSampler
    # the batches never use: the order is the batch sampler's sampler's.
    weighted = DataLoader(
        Items(), batch_sampler=BatchSampler(WeightedRandomSampler(_WEIGHTS, N, generator=_g()), 4, False)
    )
    expected = [b.flatten().tolist() for b in weighted]
    weighted.batch_sampler.sampler.generator.manual_seed(5)  # type: ignore[union-attr]
    assert [b.flatten().tolist() for b in _prepared(weighted)] == expected

    def shuffled(batch_sampler: bool) -> list[list[int]]:
        if batch_sampler:
            loader = DataLoader(Items(), batch_sampler=BatchSampler(RandomSampler(Items()), 4, True))
        else:
            loader = DataLoader(Items(), batch_size=4, shuffle=True, drop_last=True)
        return [b.flatten().tolist() for b in _prepared(loader)]

    order = shuffled(batch_sampler=True)  # made resumable as shuffle=True is, with the same order
    assert order == shuffled(batch_sampler=False)
    assert sorted(i for b in order for i in b) == list(range(N)) and order != [
        list(range(i, i + 4)) for i in range(0, N, 4)
    ]

    # A subclass of torch's samplers, or a sampler over a part of the data, stays the user's.
    class Reversed(SequentialSampler):
        def __iter__(self) -> Iterator[int]:
            return iter(range(len(self.data_source) - 1, -1, -1))

    for sampler in (Reversed(Items()), SequentialSampler(range(8))):
        loader = _prepared(DataLoader(Items(), batch_sampler=BatchSampler(sampler, 4, False)))
        assert [b.flatten().tolist() for b in loader] == [list(map(int, b)) for b in BatchSampler(sampler, 4, False)]


def test_a_generator_state_is_saved_with_the_position_and_an_old_position_without_it_still_loads() -> None:
    loader = _prepared(KINDS["weighted_generator"](0))
    epoch = iter(loader)
    next(epoch)
    state = loader.state_dict()
    sampler_generator = loader.sampler.generator  # type: ignore[union-attr]
    assert torch.equal(state["generator_states"][0]["sampler_generator"], sampler_generator.get_state())
    assert torch.equal(state["epoch_rng"][0]["sampler_generator"], _g().get_state())  # the epoch's start
    old = {k: v for k, v in state.items() if k != "generator_states"}
    resumed = _prepared(KINDS["weighted_generator"](0))
    resumed.load_state_dict(old)  # (saved before the states were: loads, the epoch is still redrawn)
    assert len(list(resumed)) == N // BATCH - 1
