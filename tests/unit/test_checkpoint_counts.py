"""One rule for "parameters": nn.Parameter elements (trainable and frozen); buffers apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import torchrig
from torchrig.checkpoint.entries import module_counts
from torchrig.cli import main


class Mixed(nn.Module):
    """A frozen and a tied parameter, BatchNorm buffers, and a buffer that is not saved."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3)  # 18
        self.out = nn.Linear(3, 6, bias=False)
        self.out.weight = self.emb.weight  # tied: counted once
        self.frozen = nn.Linear(3, 3)  # 12, frozen but a parameter
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(3)  # 6 parameters; buffers 3 + 3 + 1
        self.register_buffer("scratch", torch.zeros(100), persistent=False)  # not in a state dict


def test_parameters_count_every_parameter_once_and_buffers_apart() -> None:
    assert module_counts([Mixed()]) == {"parameters": 18 + 12 + 6, "buffers": 7}


@pytest.mark.timeout(20)
def test_meta_json_and_inspect_use_the_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model = rig.prepare(Mixed())
    path = rig.save(tmp_path / "ck", {"model": model})
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["parameters"], meta["buffers"]) == (36, 7)
    assert main(["checkpoint", "inspect", str(path)]) == 0
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.count("│") == 3
    }
    assert (rows["parameters"], rows["buffers"]) == ("36", "7")


@pytest.mark.timeout(30)
def test_the_demo_model_counts_the_same_in_the_demo_and_in_inspect(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from torchrig.demo.model import DigitsCNN

    counts = module_counts([DigitsCNN()])
    assert counts == {"parameters": 14_538, "buffers": 163}  # docs/demo.md; 160 running stats + 3 counters
    assert counts["parameters"] == sum(p.numel() for p in DigitsCNN().parameters())
    rig = torchrig.Rig(accelerator="cpu")
    path = rig.save(tmp_path / "ck", {"model": rig.prepare(DigitsCNN())})
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["parameters"], meta["buffers"]) == (14_538, 163)
