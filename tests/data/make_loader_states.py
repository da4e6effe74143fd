"""Regenerate ``loader_states.pt``: positions that prepared loaders saved (``RigDataLoader.state_dict``)
with the code of main at 1e3bb15, before the loader kept its position in one field. The test
``tests/unit/test_data_position.py::test_positions_saved_by_the_previous_version_resume_exactly``
loads each into a loader of today's code and checks it gives the batches the old loader gave.

Run it against that version of torchrig (a throwaway worktree of it, its ``src`` first on the path)::

    git worktree add --detach /tmp/old 1e3bb15
    PYTHONPATH=/tmp/old/src python tests/data/make_loader_states.py

For each pipeline it saves ``state`` (what the loader's ``state_dict()`` gave after ``stop``
batches of epoch ``epoch``), ``rng`` (torch's RNG state then, as a checkpoint holds it) and
``rest``: the ids of the batches the same loader gave after it, to the end of that epoch and
through the next one (``None`` between the two epochs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler, get_worker_info

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "loader_states.pt"
N, BATCH = 24, 4


class Items(Dataset[torch.Tensor]):
    """0 .. N-1, each as a 1-element tensor."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class Stream(IterableDataset[torch.Tensor]):
    """0 .. N-1 without a length; each worker reads every ``num_workers``-th item. With
    ``stateful``, its position is ``state_dict``/``load_state_dict``."""

    def __init__(self, stateful: bool) -> None:
        self.pos = 0
        if not stateful:
            self.state_dict = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        while (i := self.pos * workers + worker) < N:
            self.pos += 1
            yield torch.tensor([i])
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


#: name -> (the DataLoader, look_ahead, epoch of the stop, batches of it before the stop)
PIPELINES: dict[str, tuple[Callable[[], DataLoader[Any]], bool, int, int]] = {
    "shuffled": (lambda: DataLoader(Items(), batch_size=BATCH, shuffle=True), False, 1, 2),
    "shuffled_epoch_end": (lambda: DataLoader(Items(), batch_size=BATCH, shuffle=True), False, 0, 6),
    "weighted": (
        lambda: DataLoader(Items(), batch_size=BATCH, sampler=WeightedRandomSampler(torch.linspace(0.1, 1, N), N)),
        False,
        0,
        3,
    ),
    "stream": (lambda: DataLoader(Stream(True), batch_size=BATCH), False, 0, 2),
    "stream_workers": (lambda: DataLoader(Stream(True), batch_size=BATCH, num_workers=2), False, 0, 3),
    "stream_read_ahead": (lambda: DataLoader(Stream(True), batch_size=BATCH), True, 0, 3),
    "stream_read_ahead_end": (lambda: DataLoader(Stream(True), batch_size=BATCH), True, 0, 6),
    "plain_stream": (lambda: DataLoader(Stream(False), batch_size=BATCH), False, 0, 2),
}


def prepared(make: Callable[[], DataLoader[Any]], look_ahead: bool) -> Any:
    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.seed_everything(0)
    loader = rig.prepare(make())
    loader.look_ahead = look_ahead
    return loader


def ids(batch: torch.Tensor) -> list[int]:
    return batch.flatten().tolist()  # type: ignore[no-any-return]


def record(make: Callable[[], DataLoader[Any]], look_ahead: bool, epoch: int, stop: int) -> dict[str, Any]:
    loader = prepared(make, look_ahead)
    for _ in range(epoch):
        list(loader)
    it = iter(loader)
    for _ in range(stop):
        next(it)
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest: list[Any] = [ids(b) for b in it]
    return {"state": state, "rng": rng, "rest": [*rest, None, *(ids(b) for b in loader)]}


def main() -> None:
    import torchrig

    states = {name: record(*spec) for name, spec in PIPELINES.items()}
    torch.save(states, FIXTURE)
    print(f"wrote {FIXTURE} from {torchrig.__file__}")


if __name__ == "__main__":
    main()
