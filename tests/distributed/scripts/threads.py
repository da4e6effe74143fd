"""Prints, as JSON lines, the intra-op thread count every process of a run sees.

python threads.py launch     # ddp_spawn and ddp_notebook workers started by rig.launch
python threads.py one        # one ddp_spawn worker of a script that set torch.set_num_threads(1)
python threads.py ddp        # strategy="ddp": this process starts rank 1
torchrig run --devices 2 --accelerator cpu threads.py ddp
"""

from __future__ import annotations

import json
import os
import sys

import torch

import torchrig


def report(rig: torchrig.Rig, layout: str) -> None:
    seen = rig.all_gather(torch.tensor([torch.get_num_threads()])).flatten().tolist()
    if rig.is_global_zero:
        row = {"layout": layout, "threads": seen, "env": os.environ.get("OMP_NUM_THREADS")}
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.stdout.write(json.dumps({"layout": "parent", "threads": [torch.get_num_threads()]}) + "\n")
    if sys.argv[1] == "launch":
        for strategy in ("ddp_spawn", "ddp_notebook"):
            torchrig.Rig(accelerator="cpu", devices=2, strategy=strategy).launch(report, strategy)
    elif sys.argv[1] == "one":
        torch.set_num_threads(1)
        torchrig.Rig(accelerator="cpu", devices=1, strategy="ddp_spawn").launch(report, "ddp_spawn")
    else:
        report(torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp"), "ddp")
