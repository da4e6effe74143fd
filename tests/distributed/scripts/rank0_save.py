"""``rig.save`` called on rank 0 only (the ``torch.save`` habit): rank 0 is told at once why.

python rank0_save.py DIR   # strategy="ddp": this process is rank 0 and starts rank 1
Set TORCHRIG_SAVE_ARRIVAL_TIMEOUT (seconds) to wait less than the default minute.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

from torch import nn

import torchrig
from torchrig.strategies import DDPStrategy


def main(folder: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)))
    model = rig.prepare(nn.Linear(4, 1))
    if rig.is_global_zero:
        try:
            rig.save(folder / "ck", {"model": model, "step": 1})
        except RuntimeError as err:
            print(f"rank 0 error: {err}", flush=True)
    rig.barrier()  # rank 1 waits here for rank 0: the save was the only thing out of step
    # Called on every rank, the same save works (the ranks count their saves alike).
    rig.save(folder / "ck", {"model": model, "step": 2})
    if rig.is_global_zero:
        print("saved step", rig.load(folder / "last")["step"], flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
