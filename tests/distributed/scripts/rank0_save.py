"""``rig.save`` on rank 0 only (the ``torch.save`` habit), or with rank 1 arriving late.

python rank0_save.py DIR never   # rank 1 never calls rig.save: rank 0 is warned, then told why it failed
python rank0_save.py DIR late    # rank 1 calls rig.save a few seconds late: a warning, and the save works
Set TORCHRIG_SAVE_ARRIVAL_TIMEOUT (seconds) to warn sooner than the default minute.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

from torch import nn

import torchrig
from torchrig.strategies import DDPStrategy


def main(folder: Path, mode: str) -> None:
    timeout = timedelta(seconds=8 if mode == "never" else 60)
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timeout))
    model = rig.prepare(nn.Linear(4, 1))
    if mode == "never":
        if rig.is_global_zero:
            try:
                rig.save(folder / "ck", {"model": model, "step": 1})
            except RuntimeError as err:
                print(f"rank 0 error: {err}", flush=True)
        else:
            time.sleep(10)  # no collective: rank 0's save is the only thing waiting
        return
    if not rig.is_global_zero:
        time.sleep(4)
    rig.save(folder / "ck", {"model": model, "step": 2})
    if rig.is_global_zero:
        print("saved step", rig.load(folder / "last")["step"], flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
