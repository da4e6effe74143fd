"""DDP overhead of torchrig: a hand-written DDP loop vs the same loop through ``Rig``.

Both contenders run in the same 2 processes (gloo, CPU), on the same process group, model,
data and batch size, alternating in rounds so machine noise hits both alike. The table shows
the median and best time per training step (forward, backward with the gradient all-reduce,
optimizer step, data loading) and the median over rounds of Rig / hand-written. Target: <= 1.03x.

    python benchmarks/ddp_overhead.py                 # ~6 s per contender
    python benchmarks/ddp_overhead.py --seconds 20 --rounds 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

WORLD = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4096, 256, generator=g), torch.randint(0, 10, (4096,), generator=g))


def hand_written(steps: int, batch: int) -> float:
    """Seconds for ``steps`` steps of a plain DDP loop."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = make_data()
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0))
    return _loop(model, optimizer, loader, steps, backward=lambda loss: loss.backward())


def through_rig(steps: int, batch: int) -> float:
    """Seconds for ``steps`` steps of the same loop prepared by a Rig (ddp strategy, same group)."""
    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=WORLD, strategy="ddp")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(make_data(), batch_size=batch, shuffle=True)
    model, optimizer, loader = rig.prepare(model, optimizer, loader)
    return _loop(model, optimizer, loader, steps, backward=rig.backward)


def _loop(model: Any, optimizer: Any, loader: Any, steps: int, backward: Any) -> float:
    loss_fn = nn.CrossEntropyLoss()
    for i, (x, y) in enumerate(loader):  # warm-up: DDP's first iterations build its buckets
        backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if i == 2:
            break
    done, epoch = 0, 1
    dist.barrier()
    start = time.perf_counter()
    while done < steps:
        if hasattr(loader, "sampler") and isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                break
        epoch += 1
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    contenders = {"hand-written DDP": hand_written, "torchrig Rig (ddp)": through_rig}
    # Calibrate the step count so one contender run takes about --seconds.
    probe = hand_written(10, args.batch)
    steps = max(20, int(args.seconds / args.rounds / (probe / 10)))
    agreed = torch.tensor(steps)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank must run the same number of steps
    steps = int(agreed)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        order = list(contenders.items()) if r % 2 == 0 else list(reversed(contenders.items()))
        for name, fn in order:
            times[name].append(fn(steps, args.batch) / steps)
    if rank == 0:
        report(times, steps, args)
    dist.barrier()
    dist.destroy_process_group()


def report(times: dict[str, list[float]], steps: int, args: argparse.Namespace) -> None:
    hand, rig = times["hand-written DDP"], times["torchrig Rig (ddp)"]
    # Rounds alternate A-B / B-A, so each round's ratio compares neighbours in time: load from
    # other jobs on the machine shifts both alike. Its median is the headline number.
    paired = statistics.median(r / h for r, h in zip(rig, hand, strict=True))
    print(f"\nDDP overhead, {WORLD} processes, gloo on CPU, torch {torch.__version__}")
    print(f"{args.rounds} rounds x {steps} steps per contender, batch {args.batch} per process\n")
    print(f"| {'contender':<20} | {'median ms/step':>14} | {'best ms/step':>12} | {'paired ratio':>12} |")
    print(f"|{'-' * 22}|{'-' * 16}|{'-' * 14}|{'-' * 14}|")
    for name, values in times.items():
        ratio = 1.0 if values is hand else paired
        print(
            f"| {name:<20} | {statistics.median(values) * 1e3:>14.3f} | {min(values) * 1e3:>12.3f} | {ratio:>11.3f}x |"
        )
    print(f"\ncommand: python {' '.join(sys.argv)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="time per contender (all rounds)")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds (median and best are reported)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per process")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from torchrig.strategies.environment import find_free_port

    mp.start_processes(worker, args=(args, find_free_port()), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
