"""Two DDP processes prepare ``DataLoader(shuffle=True, generator=g)`` with ``g`` seeded
differently on each rank; each writes the ids it read in two epochs to ``DIR/rankR.json``.

python generator_order.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchrig


def main(folder: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
    g = torch.Generator().manual_seed(7 + 100 * rig.global_rank)  # rank 0's seed is the one that counts
    data = TensorDataset(torch.arange(40).float().unsqueeze(1))
    loader = rig.prepare(DataLoader(data, batch_size=4, shuffle=True, generator=g))
    epochs = [[int(i) for (x,) in loader for i in x.flatten().tolist()] for _ in range(2)]
    (folder / f"rank{rig.global_rank}.json").write_text(json.dumps(epochs))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
