"""Rank 0 skips one ``all_reduce``: the hang-report test.

    torchrig run --devices 2 desync.py [--timeout 10]

Both ranks do two all_reduces; rank 0 skips the second one and waits in a barrier instead.
"""

from __future__ import annotations

import argparse

import torch

import torchrig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    rig = torchrig.Rig(accelerator="cpu", strategy="ddp", timeout=args.timeout)
    rig.all_reduce(torch.ones(3))
    if rig.global_rank == 1:
        rig.all_reduce(torch.ones(3), op="sum")  # the collective rank 0 skips
    rig.barrier("end")
    print(f"rank {rig.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
