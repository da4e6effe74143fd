"""The position a prepared loader saves (``RigDataLoader.state_dict``) over its life cycle: saved
and resumed any number of times inside an epoch it gives the uninterrupted run's batches, batch
for batch; saved twice, before the first batch, after the epoch, or right after a load (nothing
consumed) it is the right one; and a position saved by the previous version still resumes."""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, WeightedRandomSampler

import torchrig
from torchrig.data import RigDataLoader

pytestmark = pytest.mark.timeout(120)

_spec = importlib.util.spec_from_file_location(
    "make_loader_states", Path(__file__).resolve().parents[1] / "data" / "make_loader_states.py"
)
assert _spec is not None and _spec.loader is not None
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)
N, BATCH, Items, Stream = fixture.N, fixture.BATCH, fixture.Items, fixture.Stream
EPOCHS = 2  # the runs below: two epochs of N // BATCH = 6 batches


def _hf_table() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"id": list(range(N))}).with_format("torch")


def _hf_stream() -> Any:
    return _hf_table().to_iterable_dataset(num_shards=4).with_format("torch")


#: name -> the DataLoader (given its number of workers) of each kind of pipeline.
KINDS: dict[str, Callable[[int], DataLoader[Any]]] = {
    "shuffled": lambda w: DataLoader(Items(), batch_size=BATCH, shuffle=True, num_workers=w),
    "weighted": lambda w: DataLoader(
        Items(), batch_size=BATCH, sampler=WeightedRandomSampler(torch.linspace(0.1, 1, N), N), num_workers=w
    ),
    "stateful_stream": lambda w: DataLoader(Stream(True), batch_size=BATCH, num_workers=w),
    "plain_stream": lambda w: DataLoader(Stream(False), batch_size=BATCH, num_workers=w),
    "hf_dataset": lambda w: DataLoader(_hf_table(), batch_size=BATCH, shuffle=True, num_workers=w),
    "hf_stream": lambda w: DataLoader(_hf_stream(), batch_size=BATCH, num_workers=w),
    # its datasets state does not hold its shuffle buffer: resumed by reading its epoch again
    "hf_stream_buffered": lambda w: DataLoader(
        _hf_stream().shuffle(seed=1, buffer_size=5), batch_size=BATCH, num_workers=w
    ),
}


#: The kinds whose loader has a length.
SIZED = {"shuffled", "weighted", "hf_dataset"}
#: The kinds whose resumed epoch reads the batches before the stop again (with a warning).
REPLAYED = {"plain_stream", "hf_stream_buffered"}


def prepared(loader: DataLoader[Any], look_ahead: bool = False) -> RigDataLoader:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.seed_everything(0)
    prepared = rig.prepare(loader)
    prepared.look_ahead = look_ahead
    return prepared  # type: ignore[no-any-return]


def ids(batch: Any) -> list[int]:
    return (batch["id"] if isinstance(batch, dict) else batch).flatten().tolist()  # type: ignore[no-any-return]


def whole_run(make: Callable[[], RigDataLoader]) -> list[list[int]]:
    loader = make()
    return [ids(b) for _ in range(EPOCHS) for b in loader]


def run_in_pieces(
    make: Callable[[], RigDataLoader], stops: list[int], end_workers: bool
) -> tuple[list[list[int]], list[str]]:
    """The batches of a run of :data:`EPOCHS` epochs whose ``i``-th loader takes ``stops[i]``
    batches (across epoch ends too), saves its position and hands it to a new loader (the
    last takes the rest), with torch's RNG state, as a checkpoint does; and the warnings of the
    resumes that read consumed batches again. ``end_workers``: each loader ends its workers
    before it saves."""
    seen: list[list[int]] = []
    state: dict[str, Any] | None = None
    rng = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for budget in [*stops, math.inf]:
            loader = make()
            if state is not None:
                loader.load_state_dict(state)
                torch.set_rng_state(rng)
            taken, over = 0, loader.epoch >= EPOCHS  # (loaded at the run's end: the next epoch is past it)
            done = over
            while not done:
                epoch = iter(loader)
                for batch in epoch:
                    seen.append(ids(batch))
                    taken += 1
                    if taken == budget:
                        if end_workers:
                            loader.end_workers()
                        state, rng = loader.state_dict(), torch.get_rng_state()
                        epoch.close()
                        done = True
                        break
                else:
                    done = over = loader.epoch >= EPOCHS - 1  # the run is over
            if over:
                return seen, [str(w.message) for w in caught if "throws them away" in str(w.message)]
    raise AssertionError("unreachable")


def _check_pieces(kind: str, workers: int, look_ahead: bool, stops: list[int], end_workers: bool) -> None:
    def make() -> RigDataLoader:
        return prepared(KINDS[kind](workers), look_ahead)

    whole = whole_run(make)
    assert len(whole) == EPOCHS * N // BATCH
    pieces, replays = run_in_pieces(make, stops, end_workers)
    assert pieces == whole
    if kind not in REPLAYED:  # the others resume from their position: nothing is read twice
        assert replays == []


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    look_ahead=st.booleans(),
    stops=st.lists(st.integers(1, 7), min_size=1, max_size=4),
)
def test_saved_and_resumed_any_number_of_times_a_run_gives_the_uninterrupted_batches(
    kind: str, look_ahead: bool, stops: list[int]
) -> None:
    # Stops of 1 to 7 batches in epochs of 6: several saves inside one epoch, on its last batch
    # and across its end; each resumed loader saves again before, or after, it took a batch.
    _check_pieces(kind, 0, look_ahead, stops, end_workers=False)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("look_ahead", [False, True], ids=["", "look_ahead"])
def test_with_workers_saved_and_resumed_three_times_in_an_epoch_gives_the_uninterrupted_batches(
    kind: str, look_ahead: bool
) -> None:
    # Saved after batches 1, 3 and 5 of the first epoch (2 of them after a resume), and after
    # batch 2 of the second; each loader ends its workers before it saves.
    _check_pieces(kind, 2, look_ahead, [1, 2, 2, 3], end_workers=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("look_ahead", [False, True], ids=["", "look_ahead"])
def test_a_state_loaded_is_saved_again_as_loaded_until_a_batch_is_consumed(kind: str, look_ahead: bool) -> None:
    # A resumed fit may save before its first batch (a validation pending at the stop): the
    # position then is the one loaded, also from a loader that had read on, twice in a row, and
    # after an iterator was made but not advanced.
    first = prepared(KINDS[kind](0), look_ahead)
    it = iter(first)
    next(it), next(it)
    saved = first.state_dict()
    rest = [ids(b) for b in it]
    assert len(rest) == 4
    for loader in (first, prepared(KINDS[kind](0), look_ahead)):  # one that read on, and a fresh one
        loader.load_state_dict(saved)
        _assert_same_state(loader.state_dict(), saved)
        _assert_same_state(loader.state_dict(), saved)  # twice: nothing moved
        not_started = iter(loader)  # (a generator: nothing happens until its first batch)
        _assert_same_state(loader.state_dict(), saved)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "resuming the .* of this loader reads", UserWarning)
            assert [ids(b) for b in not_started] == rest
        assert loader.state_dict()["batches_seen"] == 6  # consumed: the position is now the loader's own


@pytest.mark.parametrize("kind", ["shuffled", "plain_stream"])
def test_a_state_of_another_number_of_processes_is_saved_again_with_every_ranks_rng_state(kind: str) -> None:
    # Saved by 2 processes (each rank's epoch RNG state its own), loaded by 1 and saved again
    # before a batch is consumed: the state as given, rank 1's RNG state included (a 2-process
    # run resuming from it draws each rank's epoch again). tests/trainer/test_data_resume_ddp.py
    # does 4 -> 2 -> 4 on 2 real processes.
    first = prepared(KINDS[kind](0))
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    (own,) = state["epoch_rng"]
    other = {"torch": torch.randint(0, 256, own["torch"].shape, dtype=torch.uint8), "generator": None}
    state["epoch_rng"] = [own, other]  # as 2 processes save it
    loader = prepared(KINDS[kind](0))
    loader.load_state_dict(state)
    _assert_same_state(loader.state_dict(), state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "resuming the .* of this loader reads", UserWarning)
        assert len(list(loader)) == 4  # resumed after the 2 batches
    assert "epoch_rng" not in loader.state_dict()  # (another number's RNG states served no rank here)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_position_saved_mid_epoch_twice_in_a_row_is_the_same_and_resumes_there(kind: str) -> None:
    loader = prepared(KINDS[kind](0), look_ahead=True)
    it = iter(loader)
    given = [ids(next(it)) for _ in range(3)]
    once, twice = loader.state_dict(), loader.state_dict()
    _assert_same_state(once, twice)
    assert once["batches_seen"] == 3
    rest = [ids(b) for b in it]
    assert given + rest == whole_run(lambda: prepared(KINDS[kind](0)))[:6]
    for state in (once, twice):
        resumed = prepared(KINDS[kind](0), look_ahead=True)
        resumed.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "resuming the .* of this loader reads", UserWarning)
            assert [ids(b) for b in resumed] == rest


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_position_before_the_first_batch_resumes_the_whole_run(kind: str) -> None:
    whole = whole_run(lambda: prepared(KINDS[kind](0)))
    fresh = prepared(KINDS[kind](0))
    before = fresh.state_dict()
    assert (before["epoch"], before["batches_seen"]) == (-1, 0)
    iter(fresh)  # made, not advanced: still before the first batch
    _assert_same_state(fresh.state_dict(), before)
    resumed = prepared(KINDS[kind](0))
    resumed.load_state_dict(before)
    assert [ids(b) for _ in range(EPOCHS) for b in resumed] == whole


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("look_ahead", [False, True], ids=["", "look_ahead"])
def test_the_position_after_an_epoch_ended_resumes_with_the_next_epoch(kind: str, look_ahead: bool) -> None:
    # A stream read to its end (its iterator ended, no look-ahead) saved a position its batches
    # and its own state did not mark as ended: resumed, the "rest" of the ended epoch was a
    # whole new epoch of the stream (a plain stream read its epoch again), and the next epoch
    # another one. Now the rest is empty: a loader with a length resumes at the next epoch, a
    # stream (whose end is known only by reading it) gives nothing more of the ended one.
    whole = whole_run(lambda: prepared(KINDS[kind](0), look_ahead))
    loader = prepared(KINDS[kind](0), look_ahead)
    assert [ids(b) for b in loader] == whole[:6]
    ended, rng = loader.state_dict(), torch.get_rng_state()
    assert (ended["epoch"], ended["batches_seen"], ended["ended"]) == (0, 6, True)
    _assert_same_state(loader.state_dict(), ended)
    resumed = prepared(KINDS[kind](0), look_ahead)
    resumed.load_state_dict(ended)
    torch.set_rng_state(rng)
    sized = kind in SIZED
    assert (resumed.epoch, resumed.batches_seen) == ((1, 0) if sized else (0, 6))
    if not sized:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is read again
            assert [ids(b) for b in resumed] == []  # the rest of the ended epoch
    assert [ids(b) for b in resumed] == whole[6:]  # the next epoch


def test_a_refused_position_changes_nothing() -> None:
    # A stream's position saved by 2 processes is refused in a run of 1; the loader's position
    # stays the one it had (the refused state was kept and saved again as if it were loaded).
    loader = prepared(KINDS["stateful_stream"](0))
    it = iter(loader)
    next(it)
    before = loader.state_dict()
    other = dict(before, batches_seen=5, loader_state=before["loader_state"] * 2)
    with pytest.raises(ValueError, match="saved by 2 processes, each at its own position"):
        loader.load_state_dict(other)
    _assert_same_state(loader.state_dict(), before)
    assert [ids(b) for b in it] == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal, tensors (the RNG states) by value."""
    assert a.keys() == b.keys()
    for key in a:
        if key == "epoch_rng":
            assert len(a[key]) == len(b[key])
            for mine, theirs in zip(a[key], b[key], strict=True):
                assert torch.equal(mine["torch"], theirs["torch"])
                assert (mine["generator"] is None) == (theirs["generator"] is None)
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("name", sorted(fixture.PIPELINES))
def test_positions_saved_by_the_previous_version_resume_exactly(name: str) -> None:
    # tests/data/loader_states.pt: what main's loader (three position fields) saved, and the
    # batches it gave after; tests/data/make_loader_states.py made it.
    recorded = torch.load(fixture.FIXTURE, weights_only=True)[name]
    make, look_ahead, _, _ = fixture.PIPELINES[name]
    loader = prepared(make(), look_ahead)
    loader.load_state_dict(recorded["state"])
    torch.set_rng_state(recorded["rng"])
    _assert_same_state(loader.state_dict(), recorded["state"])  # saved again as it was loaded
    expected = [b for b in recorded["rest"] if b is not None]
    got: list[list[int]] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "resuming the Stream", UserWarning)
        while len(got) < len(expected):
            got += [ids(b) for b in loader]
    assert got[: len(expected)] == expected
