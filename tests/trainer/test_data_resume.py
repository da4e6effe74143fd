"""A fit stopped and resumed from ``last`` (any number of times, anywhere in an epoch) trains the
same batches and ends with the same weights, bitwise, as the fit that was never stopped."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)
from trainer_helpers import quiet_trainer

import torchrig

pytestmark = pytest.mark.timeout(60)


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """``(id, x, y)``; counts ``__getitem__`` calls."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.reads += 1
        return torch.tensor(i), self.x[i], self.y[i]


class IdRegressor(torchrig.TrainingModule):
    """Trains on ``(id, x, y)`` batches with dropout (the RNG stream must continue exactly) and
    records the ids of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
        self.trained: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x, y = (batch["id"], batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        self.trained.append(ids.tolist())
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = (batch["id"], batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit_in_pieces(
    tmp_path: Path,
    make_loader: Callable[[], DataLoader[Any]],
    stops: list[int],
    *,
    max_epochs: int = 1,
    module_class: type[IdRegressor] = IdRegressor,
    **trainer_kwargs: Any,
) -> tuple[list[list[int]], dict[str, torch.Tensor], dict[str, Any]]:
    """Fit for ``max_epochs``, stopping at each global step of ``stops`` (``max_steps``, a
    checkpoint every step) and resuming from ``last``: the batch ids trained, the final weights
    and the optimizer state."""
    trained: list[list[int]] = []
    module = IdRegressor()
    for max_steps in [*stops, -1]:
        torch.manual_seed(0)
        module = module_class()
        trainer = quiet_trainer(
            tmp_path,
            seed=7,
            max_epochs=max_epochs,
            max_steps=max_steps,
            enable_model_summary=False,
            enable_checkpointing=True,
            callbacks=[torchrig.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_last=True)],
            **trainer_kwargs,
        )
        trainer.fit(module, make_loader(), ckpt_path="last" if (tmp_path / "ck" / "last").exists() else None)
        trained += module.trained
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    return trained, weights, trainer.optimizers[0].state_dict()


def assert_same_fit(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> None:
    assert a[0] == b[0]  # the batches trained, in order
    assert a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])  # bitwise
    sa, sb = a[2]["state"], b[2]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[p][k], sb[p][k]) for p in sa for k in sa[p])


@pytest.mark.parametrize("shuffle", [False, True])
def test_three_resumes_inside_one_epoch_train_every_batch_once(tmp_path: Path, shuffle: bool) -> None:
    # 10 batches an epoch. Issue 28 item 2: resumed at batch 4, the save at batch 7 (>= 10 - 4)
    # was taken as the end of the epoch and the resume from it skipped batches 8 to 10.
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(40), batch_size=4, shuffle=shuffle)

    whole = fit_in_pieces(tmp_path / "whole", make, [], max_epochs=2)
    pieces = fit_in_pieces(tmp_path / "pieces", make, [4, 7, 9, 13], max_epochs=2)
    assert len(whole[0]) == 20
    assert_same_fit(whole, pieces)


def _weighted() -> DataLoader[Any]:
    return DataLoader(Samples(40), batch_size=4, sampler=WeightedRandomSampler(torch.rand(40) + 0.1, 40))


def _with_replacement() -> DataLoader[Any]:
    data = Samples(40)
    return DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True))


def _subset() -> DataLoader[Any]:
    return DataLoader(Samples(40), batch_size=4, sampler=SubsetRandomSampler(list(range(0, 40, 1))))


@pytest.mark.parametrize("make", [_weighted, _with_replacement, _subset], ids=["weighted", "replacement", "subset"])
def test_samplers_drawing_from_the_global_rng_resume_exactly(tmp_path: Path, make: Any) -> None:
    # The order is drawn from torch's RNG at iter(): a resumed epoch draws it again from the
    # state the epoch started with (saved in the checkpoint), not from the restored, later one.
    whole = fit_in_pieces(tmp_path / "whole", make, [], max_epochs=2)
    pieces = fit_in_pieces(tmp_path / "pieces", make, [3, 5, 8, 12], max_epochs=2)
    assert whole[0][0] != sorted(whole[0][0]) or whole[0][:10] != whole[0][10:]  # really random
    assert_same_fit(whole, pieces)


def test_a_map_style_loader_with_workers_resumes_exactly(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(24), batch_size=4, shuffle=True, num_workers=2)

    whole = fit_in_pieces(tmp_path / "whole", make, [])
    pieces = fit_in_pieces(tmp_path / "pieces", make, [2, 3, 5])
    assert_same_fit(whole, pieces)


@pytest.mark.parametrize("how", ["shuffle", "weighted", "batch_sampler"])
def test_resume_near_the_end_of_an_epoch_reads_only_what_it_trains_on(tmp_path: Path, how: str) -> None:
    data = Samples(400)

    def make() -> DataLoader[Any]:
        if how == "shuffle":
            return DataLoader(data, batch_size=4, shuffle=True)
        if how == "weighted":
            return DataLoader(data, batch_size=4, sampler=WeightedRandomSampler(torch.ones(400), 400))

        class MyBatches(BatchSampler):  # a custom batch sampler: prepare() cannot rebuild it
            pass

        return DataLoader(data, batch_sampler=MyBatches(SequentialSampler(data), batch_size=4, drop_last=False))

    fit_in_pieces(tmp_path, make, [95], max_epochs=1)
    assert data.reads == 100 * 4  # 95 batches before the stop, 5 after it: none read twice


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """``(id, x, y)`` of ``n`` samples, no ``__len__``; each worker reads every ``num_workers``-th
    sample. With ``stateful``, its position is ``state_dict``/``load_state_dict`` (in a worker,
    that worker's position)."""

    def __init__(self, n: int, stateful: bool = True) -> None:
        self.data, self.pos = Samples(n), 0
        if not stateful:
            self.state_dict = None  # type: ignore[assignment]

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        while (i := self.pos * workers + worker) < len(self.data):
            self.pos += 1
            yield self.data[i]
        self.pos = 0  # the next epoch starts from the beginning

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_stream_without_length_trains_and_resumes_exactly(tmp_path: Path, workers: int) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Stream(40), batch_size=4, num_workers=workers)

    whole = fit_in_pieces(tmp_path / "whole", make, [], max_epochs=2)
    assert sorted(i for b in whole[0][:10] for i in b) == list(range(40))  # an epoch ends with the stream
    pieces = fit_in_pieces(tmp_path / "pieces", make, [2, 5, 7, 13], max_epochs=2)
    assert_same_fit(whole, pieces)


def test_a_fit_that_stops_mid_epoch_ends_its_loader_workers_and_keeps_their_position(tmp_path: Path) -> None:
    # A StatefulDataLoader keeps its iterator, and so its worker processes, after an epoch stopped
    # early. Left for the garbage collector (the loader sits in reference cycles), they ended at
    # some later moment, where torch's shutdown waits 5 s for each worker: the 20-30 s stalls of
    # whichever test ran then. The fit ends them as it ends; the position stays where it stopped.
    import multiprocessing

    class AtFitEnd(torchrig.Callback):
        def on_fit_end(self, trainer: torchrig.Trainer, module: torchrig.TrainingModule) -> None:
            self.state = trainer.run.train_loader.state_dict()

    before = {p.pid for p in multiprocessing.active_children()}
    at_end = AtFitEnd()
    trainer = quiet_trainer(tmp_path, max_epochs=1, max_steps=3, enable_model_summary=False, callbacks=[at_end])
    trainer.fit(IdRegressor(), DataLoader(Stream(40), batch_size=4, num_workers=2))
    assert [p.pid for p in multiprocessing.active_children() if p.pid not in before] == []
    after = trainer.run.train_loader.state_dict()  # starts no workers
    assert [p.pid for p in multiprocessing.active_children() if p.pid not in before] == []
    assert after["batches_seen"] == at_end.state["batches_seen"] == 3
    assert after["loader_state"] == at_end.state["loader_state"]
    assert after["loader_state"][0]["_snapshot"]["_snapshot_step"] == 3


def test_an_evaluation_that_stops_mid_epoch_ends_its_loader_workers(tmp_path: Path) -> None:
    """docs/data.md: the Trainer ends a StatefulDataLoader's workers when a fit "(or evaluation)"
    ends in the middle of an epoch (here ``limit_val_batches`` cuts the epoch)."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    trainer = quiet_trainer(tmp_path, limit_val_batches=2, enable_model_summary=False)
    trainer.validate(IdRegressor(), DataLoader(Stream(40), batch_size=4, num_workers=2))
    assert [p.pid for p in multiprocessing.active_children() if p.pid not in before] == []


def test_a_stream_without_position_is_read_again_with_a_warning(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Stream(40, stateful=False), batch_size=4)

    whole = fit_in_pieces(tmp_path / "whole", make, [])
    with pytest.warns(UserWarning) as caught:
        pieces = fit_in_pieces(tmp_path / "pieces", make, [6])
    said = [str(w.message) for w in caught if "throws them away" in str(w.message)]
    assert said == [
        "resuming the Stream of this loader reads the 6 batches it already trained on again and throws them away, "
        "as Stream keeps no position torchrig can save; to resume without reading them, give it state_dict() and "
        "load_state_dict() (its position in the stream; docs/data.md shows how)"
    ]
    assert_same_fit(whole, pieces)


def _hf_stream() -> Any:
    from datasets import Dataset

    data = Samples(40)
    table = {"id": list(range(40)), "x": data.x.tolist(), "y": data.y.tolist()}
    return Dataset.from_dict(table).to_iterable_dataset(num_shards=4).with_format("torch")


def test_a_hugging_face_stream_with_workers_resumes_exactly(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(_hf_stream(), batch_size=4, num_workers=2)

    whole = fit_in_pieces(tmp_path / "whole", make, [])
    assert sorted(i for b in whole[0] for i in b) == list(range(40))
    pieces = fit_in_pieces(tmp_path / "pieces", make, [2, 5, 7])
    assert_same_fit(whole, pieces)


def _buffer_replayed(skip: int) -> str:
    """The warning of a resume of a Hugging Face stream shuffled with ``buffer_size=8`` after ``skip`` batches."""
    return (
        f"resuming the IterableDataset of this loader reads the {skip} batches it already trained on again and "
        "throws them away, as its state does not hold its shuffle buffer (shuffle(buffer_size=8): datasets saves "
        "the stream's position, not the examples waiting in the buffer), so the epoch is replayed from its start "
        "to give the same examples in the same order; to resume without reading them, shuffle a map-style "
        "datasets.Dataset instead (DataLoader(shuffle=True) resumes it by index)"
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hugging_face_stream_shuffled_with_a_buffer_is_reshuffled_each_epoch_and_resumes_exactly(
    tmp_path: Path, workers: int
) -> None:
    """docs/data.md: a Hugging Face stream is shuffled anew each epoch (``set_epoch`` is called for
    you). ``datasets`` saves no shuffle buffer's content: resumed from its state, the buffer was
    refilled from the position after it, and the examples that were in it were lost for the epoch.
    Its resumed epoch is now replayed from its start instead (same seed, same epoch), with a
    warning per resume that says how many batches are read again and why."""

    def make() -> DataLoader[Any]:
        stream = _hf_stream().shuffle(seed=3, buffer_size=8).map(lambda row: row)  # (mapped after: still buffered)
        return DataLoader(stream, batch_size=4, num_workers=workers)

    whole = fit_in_pieces(tmp_path / "whole", make, [], max_epochs=2)
    first, second = [i for b in whole[0][:10] for i in b], [i for b in whole[0][10:] for i in b]
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second  # epoch 1 is shuffled with its own seed
    with pytest.warns(UserWarning) as caught:
        # two resumes inside epoch 0 (after batches 3 and 6), one inside epoch 1 (its batch 3)
        pieces = fit_in_pieces(tmp_path / "pieces", make, [3, 6, 13], max_epochs=2)
    assert_same_fit(whole, pieces)  # the batches, batch for batch, and the weights, bitwise
    said = [str(w.message) for w in caught if "throws them away" in str(w.message)]
    assert said == [_buffer_replayed(3), _buffer_replayed(6), _buffer_replayed(3)]


def test_validation_at_the_end_of_an_epoch_of_a_stream_and_fractions_refused(tmp_path: Path) -> None:
    module = IdRegressor()
    trainer = quiet_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, DataLoader(Stream(16), batch_size=4), DataLoader(Samples(8), batch_size=4))
    assert trainer.global_step == 8 and "val_loss" in trainer.callback_metrics
    fraction = quiet_trainer(tmp_path, max_epochs=1, val_check_interval=0.5)
    with pytest.raises(ValueError) as err:
        fraction.fit(IdRegressor(), DataLoader(Stream(16), batch_size=4), DataLoader(Samples(8), batch_size=4))
    assert str(err.value) == (
        "val_check_interval=0.5 is a fraction of the epoch, but the training dataloader has no length (an "
        "IterableDataset without __len__); give an int number of batches between checks"
    )
    fraction.fit(IdRegressor(), DataLoader(Stream(16), batch_size=4))  # no validation: nothing to refuse
    assert fraction.global_step == 4


class Sized(IdRegressor):
    """Records ``estimated_stepping_batches`` as ``configure_optimizers`` sees it."""

    def configure_optimizers(self) -> Any:
        self.estimate = self.trainer.estimated_stepping_batches
        optimizer = super().configure_optimizers()
        if math.isinf(self.estimate):
            return optimizer
        # Sized by the estimate: OneCycleLR raises when stepped more often than total_steps.
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=self.estimate)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize(
    ("stream", "kwargs", "expected"),
    [
        (False, {"max_epochs": 2, "accumulate_grad_batches": 3}, 8),  # 10 batches: ceil(10 / 3) = 4 steps an epoch
        (False, {"max_epochs": 2, "max_steps": 5}, 5),
        (False, {"max_epochs": 2, "limit_train_batches": 4}, 8),
        (True, {"max_epochs": 1}, math.inf),  # a stream's length is unknown
        (True, {"max_epochs": -1, "max_steps": 7}, 7),
    ],
)
def test_estimated_stepping_batches_is_known_in_configure_optimizers(
    tmp_path: Path, stream: bool, kwargs: dict[str, Any], expected: float
) -> None:
    module = Sized()
    trainer = quiet_trainer(tmp_path, **kwargs)
    data = Stream(40) if stream else Samples(40)
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert module.estimate == expected
    if not math.isinf(expected):
        assert trainer.global_step == expected  # what the fit then took


class Lengths(IdRegressor):
    """Records the epoch's length as the Trainer and the loader give it at every batch."""

    seen: list[tuple[float, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loader = self.trainer.run.train_loader
        Lengths.seen.append((self.trainer.num_training_batches, len(loader)))
        return super().training_step(batch, batch_idx)


def test_the_epoch_length_stays_the_whole_epoch_after_a_resume(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(40), batch_size=4, shuffle=True)

    fit_in_pieces(tmp_path, make, [3, 6], module_class=Lengths)
    assert Lengths.seen == [(10, 10)] * 10


def test_prepare_draws_from_the_rng_only_for_a_shuffling_loader() -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    before = torch.get_rng_state()
    rig.prepare(DataLoader(Samples(8), batch_size=4))
    assert torch.equal(torch.get_rng_state(), before)  # as the hand-written loop with the same seed
    rig.prepare(DataLoader(Samples(8), batch_size=4, shuffle=True))
    assert not torch.equal(torch.get_rng_state(), before)  # the shuffle seed (seed_everything fixes it)
