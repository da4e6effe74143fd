"""``train.py``'s run with DDP carried by the accelerator, as the Accelerator documents compose it.

    python composed.py --out weights.pt --form objects|names

``objects``: ``CPUAccelerator(precision_plugin=Precision(...), training_type_plugin=DDPStrategy())``;
``names``: ``CPUAccelerator(precision="32-true", strategy="ddp")``. The Rig is given only the
accelerator and ``devices=2``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from train import train

import torchrig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--form", choices=("objects", "names"), required=True)
    args = parser.parse_args()
    if args.form == "objects":
        accelerator = torchrig.CPUAccelerator(
            precision_plugin=torchrig.Precision(name="32-true", device_type="cpu"),
            training_type_plugin=torchrig.DDPStrategy(),
        )
    else:
        accelerator = torchrig.CPUAccelerator(precision="32-true", strategy="ddp")
    rig = torchrig.Rig(accelerator=accelerator, devices=2)
    state, _ = train(rig)
    if rig.is_global_zero:
        torch.save(state, args.out)
        info = {
            "world_size": rig.world_size,
            "strategy": type(rig.strategy).__name__,
            "precision": rig.precision.name,
            "carried_objects_used": rig.strategy is accelerator.strategy and rig.precision is accelerator.precision,
        }
        Path(args.out + ".json").write_text(json.dumps(info))
    rig.barrier()


if __name__ == "__main__":
    main()
