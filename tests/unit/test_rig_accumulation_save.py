"""A hand-written loop with gradient accumulation (3 batches a step) saved by ``rig.save`` after
every batch of an epoch: saved at the end of a window it resumes to the weights of the loop never
stopped; saved inside one it warns that the gradients accumulated since the last step are not in
the checkpoint (and the resumed weights indeed differ)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchrig

pytestmark = pytest.mark.timeout(60)
ACCUMULATE, BATCHES = 3, 6


def _loop(root: Path, stop: int | None) -> tuple[torch.Tensor, list[str]]:
    """Train one epoch of 6 batches (a step every 3): stopped after ``stop`` batches, saved, and
    resumed in a new Rig; the final weight and the warnings."""
    said: list[str] = []

    def run(resume: bool, until: int | None) -> torch.Tensor:
        rig = torchrig.Rig(accelerator="cpu", devices=1)
        rig.seed_everything(0)
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rig.prepare(model, optimizer)
        data = DataLoader(TensorDataset(torch.arange(24.0).unsqueeze(1) / 24), batch_size=4, shuffle=True)
        loader = rig.prepare(data)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "data": loader}
        if resume:
            rig.load(root, state)
        for (x,) in loader:
            if loader.epoch > 0:  # (resumed after the epoch's last batch: the next epoch starts)
                break
            rig.backward(model(x).pow(2).mean() / ACCUMULATE)
            if loader.batches_seen % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
            if loader.batches_seen == until:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    rig.save(root, state)
                said.extend(str(w.message) for w in caught)
                break
        return model.weight.detach().clone()

    if stop is None:
        return run(False, None), said
    run(False, stop)
    return run(True, None), said


@pytest.mark.parametrize("stop", range(1, BATCHES + 1))
def test_a_save_inside_an_accumulation_window_warns_and_one_at_its_end_resumes_exactly(
    tmp_path: Path, stop: int
) -> None:
    whole, _ = _loop(tmp_path / "whole", None)
    resumed, said = _loop(tmp_path / "ck", stop)
    if stop % ACCUMULATE == 0:
        assert said == []
        assert torch.equal(resumed, whole)
    else:
        unstepped = stop % ACCUMULATE
        passes = f"{unstepped} backward pass{'es' if unstepped != 1 else ''}"
        assert said == [
            f"rig.save(): {passes} ran since a prepared optimizer last stepped; a checkpoint holds the weights and "
            "the optimizer's state, not the gradients accumulated since, so a run resumed from it loses them and "
            "its weights differ from the run never stopped. Save right after optimizer.step() (at the end of an "
            "accumulation window)"
        ]
        assert not torch.equal(resumed, whole)  # what it warns of
