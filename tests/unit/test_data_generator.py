"""``rig.prepare`` honours the ``torch.Generator`` of a user's ``RandomSampler``: the order is the
one that generator gives (as the unprepared DataLoader's), and a resume mid-epoch is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import torchrig
from torchrig.data import ResumableSampler, RigDataLoader

pytestmark = pytest.mark.timeout(60)

DATA = TensorDataset(torch.arange(40).float().unsqueeze(1))


def _loader(kind: str) -> DataLoader[Any]:
    """A loader whose order comes from a generator at manual_seed(7), given as torch allows."""
    g = torch.Generator().manual_seed(7)
    if kind == "loader":  # DataLoader(shuffle=True, generator=g): its RandomSampler draws from g, the workers' seed too
        return DataLoader(DATA, batch_size=8, shuffle=True, generator=g)
    return DataLoader(DATA, batch_size=8, sampler=RandomSampler(DATA, generator=g))  # the sampler's own


def _prepared(kind: str, seed: int) -> RigDataLoader:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.seed_everything(seed)  # the run's seed: it must not decide this order
    return rig.prepare(_loader(kind))  # type: ignore[no-any-return]


def _ids(batches: Any) -> list[int]:
    return [i for b in batches for i in b[0].flatten().int().tolist()]


@pytest.mark.parametrize("kind", ["loader", "sampler"])
def test_the_order_is_the_users_generators(kind: str) -> None:
    plain = _loader(kind)
    expected = [_ids(plain) for _ in range(3)]
    assert expected[0] != expected[1] and sorted(expected[0]) == list(range(40))
    for seed in (0, 1):
        prepared = _prepared(kind, seed)
        assert isinstance(prepared.sampler, ResumableSampler)
        assert [_ids(prepared) for _ in range(3)] == expected, seed  # epoch after epoch, as torch's own


@pytest.mark.parametrize("kind", ["loader", "sampler"])
def test_a_resume_mid_epoch_is_exact(kind: str, tmp_path: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    loader = _prepared(kind, 0)
    _ids(loader)  # epoch 0 moved the generator on
    it = iter(loader)  # epoch 1
    head = _ids([next(it), next(it)])
    rig.save(tmp_path / "ck", {"data": loader})
    rest, epoch_2 = _ids(it), _ids(loader)

    resumed = _prepared(kind, 5)  # as a new process builds it: its generator at manual_seed(7) again
    rig.load(tmp_path / "ck", {"data": resumed})
    assert _ids(resumed) == rest and sorted(head + rest) == list(range(40))
    assert _ids(resumed) == epoch_2  # and the generator goes on as if the run never stopped


def test_a_position_saved_by_another_number_of_processes_still_resumes_the_generators_order() -> None:
    """Each rank's torch RNG state serves no rank of another layout, but the generator's state is
    the same on every rank (prepare makes it so): it is restored, and the epoch's order with it."""
    loader = _prepared("loader", 0)
    _ids(loader)
    it = iter(loader)  # epoch 1
    next(it), next(it)
    state = loader.state_dict()
    state["epoch_rng"] = state["epoch_rng"] * 2  # as 2 processes save it (num_replicas is the global position's)
    rest = _ids(it)
    resumed = _prepared("loader", 5)
    resumed.load_state_dict(state)
    assert _ids(resumed) == rest  # without the generator's state: epoch 0's order again
