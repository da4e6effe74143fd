"""A sharded save never changes the run, even before the optimizer has state (issue 28, item 4).

DCP's ``get_optimizer_state_dict`` gives an optimizer without state one by running ``step()``
with zero gradients; AdamW's step counter then ran one ahead and the weights differed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchrig


def _run(
    rig: torchrig.Rig, steps: int, save_at: int | None, folder: Path, resume: Path | None = None
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = rig.prepare(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps)]
    start = 0
    if resume is not None:
        start = rig.load(resume, {"model": model, "optimizer": optimizer})["step"]
        assert bool(optimizer.state) == (start > 0)  # saved before any step: loaded without state, as it was
    for step in range(start, steps):
        if step == save_at:
            rig.save(folder / f"step-{step}", {"model": model, "optimizer": optimizer, "step": step})
        x, y = data[step]
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    counts = {int(s["step"]) for s in optimizer.state.values()}
    assert counts == {steps}, counts
    return [p.full_tensor().detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
def test_a_sharded_save_before_the_first_step_changes_nothing_and_resumes_exactly(tmp_path: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    plain = _run(rig, 5, None, tmp_path)
    saved = _run(rig, 5, 0, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, saved, strict=True))
    resumed = _run(rig, 5, None, tmp_path, resume=tmp_path / "step-0")
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed, strict=True))


def _metadata_keys(folder: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(60)
def test_optimizer_groups_are_saved_per_parameter_and_checkpoints_by_group_index_still_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrig.checkpoint import sharded

    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    plain = _run(rig, 5, None, tmp_path)
    _run(rig, 5, 2, tmp_path / "flat")
    keys = _metadata_keys(tmp_path / "flat" / "step-2")
    # per parameter name: each pipeline stage finds its own groups' learning rate and betas
    assert {"optimizer.param_groups.0.weight.lr", "optimizer.param_groups.2.bias.betas"} <= keys
    assert "optimizer.param_groups.0.params" not in keys
    resumed = _run(rig, 5, None, tmp_path, resume=tmp_path / "flat" / "step-2")
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed, strict=True))
    # a checkpoint of an earlier torchrig, its groups by index, resumes as exactly
    with monkeypatch.context() as patch:
        options = sharded._optimizer_options
        patch.setattr(sharded, "_optimizer_options", lambda key, nested: options(key, frozenset({key})))
        _run(rig, 5, 2, tmp_path / "nested")
    assert "optimizer.param_groups.0.params" in _metadata_keys(tmp_path / "nested" / "step-2")
    resumed = _run(rig, 5, None, tmp_path, resume=tmp_path / "nested" / "step-2")
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed, strict=True))
