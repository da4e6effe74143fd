"""Under ``accumulate_grad_batches=3`` (a loader without a length is read one batch ahead), a fit
stopped and resumed from ``last`` three times inside one epoch trains the batches of the fit never
stopped, batch for batch, and ends with its weights, bitwise, for every kind of pipeline; and a
stream's fit saved after its epoch ended (at the validation that follows) resumes with the next."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_resume import IdRegressor, Samples, Stream, _hf_stream, assert_same_fit, fit_in_pieces
from torch.utils.data import BatchSampler, DataLoader, WeightedRandomSampler
from trainer_helpers import quiet_trainer

import torchrig

pytestmark = pytest.mark.timeout(120)


def _hf_table() -> Any:
    from datasets import Dataset

    data = Samples(40)
    table = {"id": list(range(40)), "x": data.x.tolist(), "y": data.y.tolist()}
    return Dataset.from_dict(table).with_format("torch")


#: name -> the DataLoader: 40 samples, 10 batches of 4.
PIPELINES: dict[str, Callable[[], DataLoader[Any]]] = {
    "shuffled": lambda: DataLoader(Samples(40), batch_size=4, shuffle=True),
    "weighted": lambda: DataLoader(
        Samples(40), batch_size=4, sampler=WeightedRandomSampler(torch.linspace(0.1, 1, 40), 40)
    ),
    # a sampler drawing from its own generator (its state saved), inside torch's BatchSampler too
    "weighted_generator": lambda: DataLoader(
        Samples(40),
        batch_size=4,
        sampler=WeightedRandomSampler(torch.linspace(0.1, 1, 40), 40, generator=torch.Generator().manual_seed(5)),
        num_workers=2,
    ),
    "batch_sampler_weighted_generator": lambda: DataLoader(
        Samples(40),
        batch_sampler=BatchSampler(
            WeightedRandomSampler(torch.linspace(0.1, 1, 40), 40, generator=torch.Generator().manual_seed(5)), 4, False
        ),
    ),
    "stateful_stream": lambda: DataLoader(Stream(40), batch_size=4),
    "stateful_stream_workers": lambda: DataLoader(Stream(40), batch_size=4, num_workers=2),
    "plain_stream": lambda: DataLoader(Stream(40, stateful=False), batch_size=4),
    "hf_dataset": lambda: DataLoader(_hf_table(), batch_size=4, shuffle=True),
    "hf_stream": lambda: DataLoader(_hf_stream(), batch_size=4),
    # its state does not hold its shuffle buffer: each resume replays the epoch up to the stop
    "hf_stream_buffered": lambda: DataLoader(_hf_stream().shuffle(seed=3, buffer_size=8), batch_size=4, num_workers=2),
}


@pytest.mark.filterwarnings("ignore:resuming the Stream:UserWarning")  # the plain stream reads its batches again
@pytest.mark.filterwarnings("ignore:resuming the IterableDataset:UserWarning")  # and the buffered one
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_three_resumes_inside_an_accumulating_epoch_train_the_uninterrupted_batches(tmp_path: Path, name: str) -> None:
    # Steps after batches 3, 6, 9 and 10 (the last, partial window): stopped after each of the
    # first three, each resumed fit saves again and is resumed in turn.
    kwargs: dict[str, Any] = {"max_epochs": 1, "accumulate_grad_batches": 3}
    whole = fit_in_pieces(tmp_path / "whole", PIPELINES[name], [], **kwargs)
    assert len(whole[0]) == 10 and whole[2]["state"][0]["step"] == 4  # the partial window stepped
    pieces = fit_in_pieces(tmp_path / "pieces", PIPELINES[name], [1, 2, 3], **kwargs)
    assert_same_fit(whole, pieces)


class StopAfterFirstValidation(torchrig.Callback):
    """Saves a checkpoint where the first epoch's validation ends, and stops the fit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer: torchrig.Trainer, module: torchrig.TrainingModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


@pytest.mark.filterwarnings("ignore:resuming the Stream:UserWarning")
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("name", ["stateful_stream", "plain_stream", "hf_stream", "hf_stream_buffered"])
def test_a_stream_saved_after_its_epoch_ended_resumes_with_the_next_epoch(
    tmp_path: Path, name: str, accumulate: int
) -> None:
    # Without a length, the epoch's end is known when the stream ends; the validation after it
    # saves a position of an epoch read to its end. The resumed fit trained a whole new epoch of
    # a stateful stream as the "rest" of that one (a third epoch of data in a fit of two).
    def fit(callbacks: list[torchrig.Callback], ckpt_path: Path | None = None) -> list[list[int]]:
        torch.manual_seed(0)
        module = IdRegressor()
        trainer = quiet_trainer(
            tmp_path, seed=7, max_epochs=2, accumulate_grad_batches=accumulate, callbacks=callbacks,
            num_sanity_val_steps=0, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, PIPELINES[name](), DataLoader(Samples(8), batch_size=4), ckpt_path=ckpt_path)
        return module.trained

    whole = fit([])
    assert len(whole) == 20
    saved = tmp_path / "at_validation.ckpt"
    first = fit([StopAfterFirstValidation(saved)])
    assert len(first) == 10
    assert first + fit([], saved) == whole
