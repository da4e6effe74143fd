"""Prepared dataloaders: batches on the device, epochs, and exact mid-epoch resume."""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import torchrig
from torchrig.data import ResumableSampler, RigDataLoader

pytestmark = pytest.mark.timeout(15)
DATA = TensorDataset(torch.arange(40).float().unsqueeze(1))


def _prepared(loader: DataLoader[Any], seed: int = 0) -> RigDataLoader:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.seed_everything(seed)
    return rig.prepare(loader)  # type: ignore[no-any-return]


def _ids(batches: list[Any]) -> list[list[int]]:
    return [b[0].flatten().int().tolist() for b in batches]


def test_batches_arrive_on_the_device_of_the_loader() -> None:
    loader = RigDataLoader(DataLoader(DATA, batch_size=8), device=torch.device("meta"))
    batches = list(loader)
    assert len(batches) == len(loader) == 5
    assert all(b[0].device == torch.device("meta") for b in batches)


def test_prepared_loader_keeps_len_batch_size_and_dataset() -> None:
    loader = _prepared(DataLoader(DATA, batch_size=8, shuffle=True))
    assert len(loader) == 5 and loader.batch_size == 8 and loader.dataset is DATA
    assert isinstance(loader.sampler, ResumableSampler)
    assert not loader.pin_memory  # nothing to pin for on the CPU


def test_each_epoch_is_a_new_permutation_and_covers_the_data() -> None:
    loader = _prepared(DataLoader(DATA, batch_size=8, shuffle=True))
    first, second = _ids(list(loader)), _ids(list(loader))
    assert first != second
    assert sorted(chain(*first)) == sorted(chain(*second)) == list(range(40))


def test_order_depends_only_on_the_seed() -> None:
    a = _ids(list(_prepared(DataLoader(DATA, batch_size=8, shuffle=True), seed=3)))
    b = _ids(list(_prepared(DataLoader(DATA, batch_size=8, shuffle=True), seed=3)))
    assert a == b


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_gives_exactly_the_remaining_batches_of_the_same_epoch(shuffle: bool) -> None:
    loader = _prepared(DataLoader(DATA, batch_size=8, shuffle=shuffle))
    list(loader)  # epoch 0
    it = iter(loader)  # epoch 1
    seen = [next(it) for _ in range(2)]
    state = loader.state_dict()
    rest = _ids(list(it))
    assert state["epoch"] == 1 and state["batches_seen"] == 2

    resumed = _prepared(DataLoader(DATA, batch_size=8, shuffle=shuffle), seed=99)  # another seed
    resumed.load_state_dict(state)
    assert _ids(list(resumed)) == rest
    assert len(rest) + len(seen) == 5
    nxt = _ids(list(resumed))  # then epoch 2, as the uninterrupted run would have had
    assert nxt == _ids(list(loader))


def test_resume_at_the_end_of_an_epoch_starts_the_next_one() -> None:
    loader = _prepared(DataLoader(DATA, batch_size=8, shuffle=True))
    list(loader)
    state = loader.state_dict()
    expected = _ids(list(loader))
    resumed = _prepared(DataLoader(DATA, batch_size=8, shuffle=True), seed=5)
    resumed.load_state_dict(state)
    assert _ids(list(resumed)) == expected


def test_loader_with_a_custom_batch_sampler_resumes_by_skipping() -> None:
    class MyBatches(BatchSampler):
        pass

    def make() -> DataLoader[Any]:
        return DataLoader(DATA, batch_sampler=MyBatches(SequentialSampler(DATA), batch_size=8, drop_last=False))

    loader = _prepared(make())
    assert not isinstance(loader.sampler, ResumableSampler)  # left as the user built it
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = _ids(list(it))
    resumed = _prepared(make())
    resumed.load_state_dict(state)
    assert _ids(list(resumed)) == rest


def test_resumable_sampler_splits_across_replicas_like_one_big_batch() -> None:
    full = ResumableSampler(DATA, shuffle=True, seed=1).indices()
    parts = [ResumableSampler(DATA, shuffle=True, seed=1, num_replicas=4, rank=r).indices() for r in range(4)]
    assert sorted(chain(*parts)) == sorted(full)
    assert [parts[r][0] for r in range(4)] == full[:4]


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """0..n-1 with its position as its state."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def test_a_stateful_stream_runs_in_a_stateful_dataloader_and_resumes_from_its_position() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = _prepared(DataLoader(_Stream(20), batch_size=4))
    assert isinstance(loader.loader, StatefulDataLoader)
    own = StatefulDataLoader(_Stream(20), batch_size=4)
    assert _prepared(own).loader is own  # a StatefulDataLoader of the user's is kept as it is
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert [s["dataset_state"] for s in state["loader_state"]] == [{"pos": 8}]
    resumed = _prepared(DataLoader(_Stream(20), batch_size=4))
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]


def _hf_buffered(n: int = 16) -> Any:
    from datasets import Dataset

    stream = Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=4).with_format("torch")
    return stream.shuffle(seed=1, buffer_size=8)


def test_a_hugging_face_stream_shuffled_with_a_buffer_is_found_through_the_steps_after_it() -> None:
    # datasets' state of such a stream holds its position, not its buffer: it keeps no position
    # torchrig can resume from, also mapped, filtered, batched, split, interleaved... after.
    from datasets import Dataset, interleave_datasets
    from datasets.distributed import split_dataset_by_node

    from torchrig.data.iterable import keeps_position, shuffle_buffer

    table = Dataset.from_dict({"id": list(range(16))})
    plain, buffered = table.to_iterable_dataset(num_shards=4), _hf_buffered()
    # datasets has no public way to say a stream is shuffled with a buffer: shuffle_buffer walks its
    # private chain of examples iterables. If datasets renames it, this says so (not a silent None).
    from datasets.iterable_dataset import BufferShuffledExamplesIterable

    chain = getattr(buffered, "_ex_iterable", None)
    assert chain is not None and hasattr(chain, "ex_iterable"), (
        "datasets changed IterableDataset's private _ex_iterable chain: torchrig.data.iterable.shuffle_buffer "
        "no longer finds a shuffle buffer; find it another way"
    )
    assert isinstance(chain, BufferShuffledExamplesIterable) or isinstance(
        chain.ex_iterable, BufferShuffledExamplesIterable
    ), f"datasets' chain of a buffered stream starts {type(chain).__name__}: shuffle_buffer must follow the change"
    for after in (
        buffered,
        buffered.map(lambda row: row),
        buffered.filter(lambda row: True),
        buffered.batch(2),
        buffered.take(10),
        split_dataset_by_node(buffered, rank=1, world_size=2),
        interleave_datasets([plain, buffered]),
    ):
        assert shuffle_buffer(after) == 8
        assert not keeps_position(after)
    for unbuffered in (plain, plain.map(lambda row: row), interleave_datasets([plain, plain])):
        assert shuffle_buffer(unbuffered) is None
        assert keeps_position(unbuffered)
    assert shuffle_buffer(table.shuffle(seed=0)) is shuffle_buffer(_Stream(4)) is None  # map-style; not datasets'
    assert not keeps_position(table) and keeps_position(_Stream(4))


def test_a_hugging_face_stream_shuffled_with_a_buffer_runs_in_a_plain_dataloader_on_every_rank() -> None:
    from datasets import IterableDataset as HFIterable
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchrig.data import rebuild_iterable
    from torchrig.data.iterable import shuffle_buffer

    loader = _prepared(DataLoader(_hf_buffered(), batch_size=4))
    assert type(loader.loader) is DataLoader  # its state could not resume it: no StatefulDataLoader
    shares = []
    for rank in range(2):  # under 2 processes, each rank's share, still in a plain DataLoader
        share = rebuild_iterable(DataLoader(_hf_buffered(), batch_size=4), kwargs={}, num_replicas=2, rank=rank)
        assert type(share) is DataLoader and isinstance(share.dataset, HFIterable)
        assert shuffle_buffer(share.dataset) == 8
        shares.append(sorted(i for batch in share for i in batch["id"].tolist()))
    assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == list(range(16))
    assert type(_prepared(DataLoader(_Stream(8), batch_size=4)).loader) is StatefulDataLoader  # (others still are)


def test_a_stateful_dataloader_of_a_buffered_stream_saves_no_stream_state_and_replays_its_epoch() -> None:
    # A StatefulDataLoader the user made is kept; its datasets state (without the buffer) is
    # neither saved nor, from a checkpoint that holds it, loaded: the epoch is read again.
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> RigDataLoader:
        return _prepared(StatefulDataLoader(_hf_buffered(), batch_size=4))

    whole = [b["id"].tolist() for b in make()]
    loader = make()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert "loader_state" not in state and state["batches_seen"] == 2
    with_stream_state = dict(state, loader_state=[loader.loader.state_dict()])  # as the previous version saved it
    for saved in (state, with_stream_state):
        resumed = make()
        resumed.load_state_dict(saved)
        with pytest.warns(UserWarning, match="reads the 2 batches it already trained on again") as caught:
            assert [b["id"].tolist() for b in resumed] == whole[2:]
        assert "its state does not hold its shuffle buffer (shuffle(buffer_size=8)" in str(caught[0].message)


def test_a_stream_shuffled_with_a_buffer_but_no_seed_is_in_another_order_each_time_it_is_built() -> None:
    # docs/data.md: give shuffle a seed. Without one, datasets draws the order from fresh entropy
    # when the stream is built, whatever seed_everything set: a resumed process builds another.
    from datasets import Dataset

    table = Dataset.from_dict({"id": list(range(40))})
    orders = []
    for _ in range(2):
        torchrig.Rig(accelerator="cpu", devices=1).seed_everything(0)
        orders.append([row["id"] for row in table.to_iterable_dataset(num_shards=4).shuffle(buffer_size=8)])
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(40))
    assert orders[0] != orders[1]


def test_a_stream_position_saved_by_another_number_of_processes_is_refused() -> None:
    loader = _prepared(DataLoader(_Stream(20), batch_size=4))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["loader_state"] = state["loader_state"] * 2  # as 2 processes save it
    with pytest.raises(ValueError) as err:
        _prepared(DataLoader(_Stream(20), batch_size=4)).load_state_dict(state)
    assert str(err.value) == (
        "the checkpoint's _Stream stream was saved by 2 processes, each at its own position in its share of the "
        "stream; this run has 1. Resume it with 2 processes: a position in one share of a stream does not say "
        "where another number of shares would be"
    )


class _Seeds(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is ``(i, the seed of the process that made it)``: a worker's is its epoch's base seed + id."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, torch.initial_seed()


def _seeded_loader() -> RigDataLoader:
    """Workers whose base seed the loader's own ``generator=`` draws (torch's global RNG is not used)."""
    loader = DataLoader(_Seeds(), batch_size=2, num_workers=1, generator=torch.Generator().manual_seed(5))
    return _prepared(loader)


def _pairs(batches: Any) -> list[list[tuple[int, int]]]:
    return [list(zip(i.tolist(), s.tolist(), strict=True)) for i, s in batches]


def test_the_loaders_own_generator_is_saved_and_restored_with_the_epoch(tmp_path: Any) -> None:
    """docs/data.md: "The loader's own ``generator=`` is saved and restored with the epoch", so the
    resumed epoch's workers get its base seed again (in a fresh process the generator starts over,
    which would give epoch 1 the seed of epoch 0)."""
    loader = _seeded_loader()
    epoch_0 = _pairs(loader)
    it = iter(loader)  # epoch 1
    next(it), next(it)
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.save(tmp_path / "ck", {"data": loader})
    rest, epoch_2 = _pairs(it), _pairs(loader)
    assert {s for b in rest for _, s in b} != {s for b in epoch_0 for _, s in b}  # a new base seed each epoch

    resumed = _seeded_loader()  # as a new process builds it: its generator at manual_seed(5) again
    rig.load(tmp_path / "ck", {"data": resumed})
    assert _pairs(resumed) == rest
    assert _pairs(resumed) == epoch_2  # and the generator goes on as in the run never stopped


@pytest.mark.parametrize("kind", ["weighted", "random"])
def test_a_samplers_own_generator_is_in_the_checkpoint(kind: str) -> None:
    """docs/data.md, "Exact": a sampler given its own ``torch.Generator`` has that generator's
    state at the epoch's start saved with the position, so the resumed epoch is drawn again from
    it, not from the state the generator has in the new process (a ``RandomSampler``, which
    ``prepare`` replaces by a ``ResumableSampler`` drawing from the same generator, too)."""

    def make() -> RigDataLoader:
        g = torch.Generator().manual_seed(1)
        if kind == "weighted":
            sampler: Any = torch.utils.data.WeightedRandomSampler(torch.ones(40), 40, generator=g)
        else:
            sampler = torch.utils.data.RandomSampler(DATA, generator=g)
        return _prepared(DataLoader(DATA, batch_size=8, sampler=sampler))

    loader = make()
    assert isinstance(loader.sampler, ResumableSampler) is (kind == "random")
    list(loader)  # epoch 0 moved the sampler's generator on
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = _ids(list(it))
    resumed = make()  # a new process: the generator at manual_seed(1) again
    resumed.load_state_dict(state)
    again = _ids(list(resumed))
    assert len(again) == len(rest) == 3
    assert again == rest  # epoch 1's order, not epoch 0's again (the generator's state in the new process)
