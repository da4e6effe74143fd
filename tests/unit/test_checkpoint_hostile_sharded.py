"""Sharded (DCP) checkpoints from a stranger: DCP's ``.metadata`` pickle never runs code, on any path
that reads it; and sharded loads give plain values back in ``state`` like whole ones (issue 14, sections 1, 5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchrig


def _trained(rig: torchrig.Rig, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = rig.prepare(nn.Linear(4, 3))
    optimizer = rig.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _full(model: nn.Module) -> list[torch.Tensor]:
    """The module's tensors, whole (an FSDP parameter is a DTensor)."""
    return [t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone() for t in model.state_dict().values()]


# -- section 5: plain values come back in ``state`` for whole and sharded checkpoints ----------------
@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_a_load_updates_the_plain_values_of_state(tmp_path: Path, strategy: str) -> None:
    rig = torchrig.Rig(accelerator="cpu", strategy=strategy)
    model, optimizer = _trained(rig, seed=0)
    path = rig.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 7, "best": {"loss": 0.5}})
    assert json.loads((path / "meta.json").read_text())["sharded"] is (strategy == "fsdp")
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "best": None}
    left = rig.load(path, state)
    assert state["step"] == 7 and state["best"] == {"loss": 0.5}
    assert left["step"] == 7 and state["model"] is model and state["optimizer"] is optimizer
