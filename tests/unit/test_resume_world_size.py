"""A dataloader position saved with one number of processes / batch size, resumed with another.

The ranks of a :class:`ResumableSampler` together walk one global order, so the position is
"global samples consumed"; these tests build the per-rank loaders of an N-process run directly
(``num_replicas``/``rank``), no processes needed.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from torchrig.data import ResumableSampler, RigDataLoader

pytestmark = pytest.mark.timeout(15)
DATA = TensorDataset(torch.arange(40))
SEED = 7
CPU = torch.device("cpu")


def _loader(batch_size: int, num_replicas: int = 1, rank: int = 0, seed: int = SEED) -> RigDataLoader:
    sampler = ResumableSampler(DATA, shuffle=True, seed=seed, num_replicas=num_replicas, rank=rank)
    return RigDataLoader(DataLoader(DATA, batch_size=batch_size, sampler=sampler), device=CPU, seed=seed)


def _ids(batches: Any) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def _global_order(epoch: int) -> list[int]:
    sampler = ResumableSampler(DATA, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return sampler.indices()


def _two_process_state(batches: int, batch_size: int = 4) -> dict[str, Any]:
    """The loader state of a 2-process run after epoch 0 and ``batches`` batches of epoch 1."""
    states = []
    for rank in range(2):
        loader = _loader(batch_size, num_replicas=2, rank=rank)
        list(loader)  # epoch 0
        it = iter(loader)  # epoch 1
        for _ in range(batches):
            next(it)
        state = loader.state_dict()
        # The RNG state each rank's epoch started from is its own (one process plays both ranks here).
        assert [type(s) for s in state.pop("epoch_rng")] == [dict]
        states.append(state)
    assert states[0] == states[1]  # every rank saves the same position (rank 0 writes it)
    return states[0]


def test_state_records_the_global_sample_position_and_the_layout() -> None:
    state = _two_process_state(3)
    assert state == {
        "epoch": 1,
        "batches_seen": 3,
        "seed": SEED,
        "samples_seen": 24,  # 3 batches x 4 samples x 2 processes
        "num_replicas": 2,
        "batch_size": 4,
    }


@pytest.mark.parametrize("batch_size", [8, 4])
def test_two_processes_resumed_on_one_continue_with_the_next_global_samples(batch_size: int) -> None:
    state = _two_process_state(3)  # 24 samples of epoch 1 consumed
    uninterrupted = _loader(batch_size)
    list(uninterrupted)
    expected = _ids(uninterrupted)[24 // batch_size :]
    assert list(chain(*expected)) == _global_order(1)[24:]

    resumed = _loader(batch_size, seed=99)  # the seed comes from the checkpoint
    resumed.load_state_dict(state)
    assert _ids(resumed) == expected
    assert resumed.batches_seen == len(resumed) and resumed.epoch == 1
    uninterrupted_next = _ids(uninterrupted)
    assert _ids(resumed) == uninterrupted_next  # and epoch 2 as the uninterrupted run has it


def test_one_process_resumed_on_two_continues_with_the_next_global_samples() -> None:
    single = _loader(4)
    list(single)
    it = iter(single)
    for _ in range(4):  # 16 samples of epoch 1
        next(it)
    state = single.state_dict()
    ranks = []
    for rank in range(2):
        resumed = _loader(4, num_replicas=2, rank=rank)
        resumed.load_state_dict(state)
        ranks.append(_ids(resumed))
    # step by step, the two ranks' batches together are the next 8 global samples
    together = [sorted(a + b) for a, b in zip(ranks[0], ranks[1], strict=True)]
    order = _global_order(1)
    assert together == [sorted(order[i : i + 8]) for i in range(16, 40, 8)]


def test_a_position_inside_a_global_batch_resumes_at_its_start_and_warns() -> None:
    state = _two_process_state(3)  # 24 samples
    resumed = _loader(10)
    message = (
        "the checkpoint's dataloader stopped 24 samples into epoch 1 (saved with num_replicas=2 x "
        "batch_size=4); this run takes 10 samples per step (num_replicas=1 x batch_size=10) and 24 is "
        "not a multiple of 10, so it resumes at sample 20 and 4 samples will be seen again"
    )
    resumed.load_state_dict(state)  # said when the resumed epoch starts, not before
    order = _global_order(1)
    with pytest.warns(UserWarning, match=re.escape(message)):
        assert _ids(resumed) == [order[20:30], order[30:40]]


def test_a_finished_epoch_resumes_at_the_next_epoch_under_another_layout() -> None:
    # 2 processes x batch 8: 20 samples per rank, batches of 8, 8, 4; the epoch ends at 40 samples
    state = _two_process_state(3, batch_size=8)
    assert state["samples_seen"] == len(DATA)
    resumed = _loader(16)  # 3 batches of 16, 16, 8: without the end-of-epoch mark it would resume at 32
    resumed.load_state_dict(state)
    order = _global_order(2)
    assert _ids(resumed) == [order[0:16], order[16:32], order[32:40]]


def test_an_old_state_without_the_sample_position_resumes_by_batches() -> None:
    old = {"epoch": 1, "batches_seen": 2, "seed": SEED}
    resumed = _loader(8)
    resumed.load_state_dict(old)
    order = _global_order(1)
    assert _ids(resumed) == [order[i : i + 8] for i in range(16, 40, 8)]


def test_a_loader_that_was_not_rebuilt_resumes_by_batches() -> None:
    class MyBatches(BatchSampler):
        pass

    loader = RigDataLoader(
        DataLoader(DATA, batch_sampler=MyBatches(SequentialSampler(DATA), batch_size=8, drop_last=False)), device=CPU
    )
    assert "samples_seen" not in loader.state_dict()
    state = _two_process_state(1)  # a new-format state: its sample position cannot be used here
    loader.load_state_dict(state)
    assert _ids(loader) == [list(range(i, i + 8)) for i in range(8, 40, 8)]


def test_a_loaded_position_is_saved_again_as_given_until_the_next_epoch_starts() -> None:
    """docs/data.md: "A loader's ``state_dict()`` between ``load_state_dict(state)`` and its next
    ``iter()`` is ``state`` as given", so a position handed on to another loader (the
    BatchSizeFinder's loader of a new size, on resume) is not rounded to its batches."""
    state = _two_process_state(3)  # 24 samples: inside this loader's second batch of 10
    handed_on = _loader(10)
    handed_on.load_state_dict(state)
    assert handed_on.state_dict() == state  # not 20 samples (2 of its batches), nor 24 rounded up
    onward = _loader(4, num_replicas=2)  # ... so the next loader resumes where the checkpoint was
    onward.load_state_dict(handed_on.state_dict())
    order = _global_order(1)
    assert list(chain(*_ids(onward))) == order[24:40:2]  # rank 0's share of the samples after 24
    with pytest.warns(UserWarning, match="4 samples will be seen again"):
        list(handed_on)  # an epoch started: from now on its own position
    assert handed_on.state_dict()["samples_seen"] == 40


def _stream_loader(rank: int = 0, shares: int = 1) -> RigDataLoader:
    """Rank ``rank``'s loader of a Hugging Face stream shuffled with a buffer (resumed by replaying
    its epoch) split into ``shares`` (1: read whole), as ``prepare`` makes it on a rank of a run
    with that many data-parallel processes."""
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    stream = Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=6)
    if shares > 1:
        stream = split_dataset_by_node(stream, rank=rank, world_size=shares)
    return RigDataLoader(DataLoader(stream, batch_size=4), device=CPU, shares=shares)


def _stream_ids(loader: RigDataLoader) -> list[list[int]]:
    return [batch["id"].tolist() for batch in loader]


def _replayed_stream_state(shares: int) -> dict[str, Any]:
    loader = _stream_loader(0, shares)
    it = iter(loader)
    for _ in range(3):
        next(it)
    return loader.state_dict()


def test_a_replayed_stream_split_across_processes_is_refused_under_another_number() -> None:
    # Rank 0 of 2 read 3 batches of its share; replayed on 1 process the next batches would be
    # the whole stream's after its first 3, not the uninterrupted 2-process run's: refused, as a
    # stream with a position is, and the loader keeps its own position.
    state = _replayed_stream_state(shares=2)
    assert state["num_replicas"] == 2
    loader = _stream_loader()
    with pytest.raises(ValueError) as err:
        loader.load_state_dict(state)
    assert str(err.value) == (
        "the checkpoint's IterableDataset stream was saved by 2 processes, each at its own position in its share "
        "of the stream; this run has 1. Resume it with 2 processes: a position in one share of a stream does not "
        "say where another number of shares would be"
    )
    assert loader.state_dict()["epoch"] == -1  # (nothing was taken from the refused state)
    assert _stream_ids(loader) == _stream_ids(_stream_loader())
    with pytest.raises(ValueError, match=r"saved by 2 processes.*this run has 4\. Resume it with 2 processes"):
        _stream_loader(1, shares=4).load_state_dict(state)
    # One process read the stream whole: each of 2 replaying 3 batches of its half would skip others.
    with pytest.raises(ValueError, match=r"saved by 1 process, .*this run has 2\. Resume it with 1 process:"):
        _stream_loader(0, shares=2).load_state_dict(_replayed_stream_state(shares=1))


@pytest.mark.parametrize("shares", [2, 1], ids=["split", "read_whole"])
def test_a_replayed_stream_resumes_under_its_split_and_one_read_whole_under_any_number(shares: int) -> None:
    # Split: under as many processes as saved it. Read whole by every process (1 share): the 3
    # batches of one are those of any, and so are the next, so it resumes under any number of
    # processes that read it whole (each here as rank 0 of its run: the same loader).
    state = _replayed_stream_state(shares)
    assert state["num_replicas"] == shares
    resumed = _stream_loader(0, shares)
    with pytest.warns(UserWarning, match="reads the 3 batches"):
        resumed.load_state_dict(state)
        batches = _stream_ids(resumed)
    assert batches == _stream_ids(_stream_loader(0, shares))[3:]


def test_a_replayed_stream_position_saved_before_its_split_was_recorded_still_resumes() -> None:
    # A checkpoint written before ``num_replicas`` was saved for a stream has no count to check: it loads.
    state = _replayed_stream_state(shares=2)
    del state["num_replicas"]
    resumed = _stream_loader(0, shares=2)
    with pytest.warns(UserWarning, match="reads the 3 batches"):
        resumed.load_state_dict(state)
        batches = _stream_ids(resumed)
    assert batches == _stream_ids(_stream_loader(0, shares=2))[3:]
    assert resumed.state_dict()["num_replicas"] == 2  # saved from now on
