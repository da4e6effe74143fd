"""``rig.prepare`` under 2 DDP processes honours the generator of ``DataLoader(shuffle=True,
generator=g)``: rank 0's generator decides the order (prepare gives its state to every rank), and
the ranks split it without overlap, as one process would read it in batches twice the size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_helpers import SCRIPTS, explain, run
from torch.utils.data import DataLoader, TensorDataset


@pytest.mark.timeout(120)
def test_ranks_split_the_order_of_rank_zeros_generator(tmp_path: Path) -> None:
    proc = run([str(SCRIPTS / "generator_order.py"), str(tmp_path)], timeout=100)
    assert proc.returncode == 0, explain(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    data = TensorDataset(torch.arange(40).float().unsqueeze(1))
    plain = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7))
    for epoch in range(2):
        order = [int(i) for (x,) in plain for i in x.flatten().tolist()]
        assert ranks[0][epoch] == order[0::2] and ranks[1][epoch] == order[1::2], epoch
    assert ranks[0][0] != ranks[0][1]
