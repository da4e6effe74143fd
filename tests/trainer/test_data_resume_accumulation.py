"""Under ``accumulate_grad_batches=3`` (a loader without a length is read one batch ahead), a fit
stopped and resumed from ``last`` three times inside one epoch trains the batches of the fit never
stopped, batch for batch, and ends with its weights, bitwise, for every kind of pipeline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_resume import Samples, Stream, _hf_stream, assert_same_fit, fit_in_pieces
from torch.utils.data import DataLoader, WeightedRandomSampler

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
    "stateful_stream": lambda: DataLoader(Stream(40), batch_size=4),
    "stateful_stream_workers": lambda: DataLoader(Stream(40), batch_size=4, num_workers=2),
    "plain_stream": lambda: DataLoader(Stream(40, stateful=False), batch_size=4),
    "hf_dataset": lambda: DataLoader(_hf_table(), batch_size=4, shuffle=True),
    "hf_stream": lambda: DataLoader(_hf_stream(), batch_size=4),
}


@pytest.mark.filterwarnings("ignore:resuming the Stream:UserWarning")  # the plain stream reads its batches again
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_three_resumes_inside_an_accumulating_epoch_train_the_uninterrupted_batches(tmp_path: Path, name: str) -> None:
    # Steps after batches 3, 6, 9 and 10 (the last, partial window): stopped after each of the
    # first three, each resumed fit saves again and is resumed in turn.
    kwargs: dict[str, Any] = {"max_epochs": 1, "accumulate_grad_batches": 3}
    whole = fit_in_pieces(tmp_path / "whole", PIPELINES[name], [], **kwargs)
    assert len(whole[0]) == 10 and whole[2]["state"][0]["step"] == 4  # the partial window stepped
    pieces = fit_in_pieces(tmp_path / "pieces", PIPELINES[name], [1, 2, 3], **kwargs)
    assert_same_fit(whole, pieces)
