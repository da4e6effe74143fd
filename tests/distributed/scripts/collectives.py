"""Every Rig collective on 2 processes started by ``ddp_spawn`` (``rig.launch(fn)``).

Each rank asserts what it receives; rank 0 returns a summary that the parent prints, and then
what ``rig.all_reduce`` says in the parent, which is no rank.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import torchrig


def check(rig: torchrig.Rig) -> str:
    rank, world = rig.global_rank, rig.world_size
    assert world == 2, world
    # all_gather on a nested collection
    out = rig.all_gather({"a": torch.tensor([rank, rank + 10]), "b": [torch.tensor(float(rank))]})
    assert torch.equal(out["a"], torch.tensor([[0, 10], [1, 11]])), out
    assert torch.equal(out["b"][0], torch.tensor([0.0, 1.0])), out
    # all_reduce: every op, input untouched
    t = torch.tensor([1.0 + rank, 5.0 - rank])
    assert torch.equal(rig.all_reduce(t, op="sum"), torch.tensor([3.0, 9.0]))
    assert torch.equal(rig.all_reduce(t, op="mean"), torch.tensor([1.5, 4.5]))
    assert torch.equal(rig.all_reduce(t, op="max"), torch.tensor([2.0, 5.0]))
    assert torch.equal(rig.all_reduce(t, op="min"), torch.tensor([1.0, 4.0]))
    assert torch.equal(t, torch.tensor([1.0 + rank, 5.0 - rank])), "all_reduce changed its input"
    assert torch.allclose(rig.all_reduce(torch.tensor(rank), op="mean"), torch.tensor(0.5, dtype=torch.float64))
    # broadcast: tensors and any picklable object
    assert torch.equal(rig.broadcast(torch.full((2,), float(rank)), src=1), torch.ones(2))
    assert rig.broadcast({"from": rank, "tags": ["x"]}, src=0) == {"from": 0, "tags": ["x"]}
    # boolean decisions
    assert rig.reduce_boolean_decision(True) is True
    assert rig.reduce_boolean_decision(rank == 0, all=True) is False
    assert rig.reduce_boolean_decision(rank == 0, all=False) is True
    # barrier and rank_zero_first ordering: rank 1 must see what rank 0 wrote
    rig.barrier("start")
    marker = Path(tempfile.gettempdir()) / f"torchrig-rank-zero-first-{os.environ['MASTER_PORT']}"
    with rig.rank_zero_first():
        if rank == 0:
            marker.write_text("rank 0 was here")
        else:
            assert marker.read_text() == "rank 0 was here", "rank 1 entered before rank 0 finished"
    rig.barrier()
    if rank == 0:
        marker.unlink()
    # sync_grads: gradients flow back through all_gather to every rank's input
    x = torch.tensor([rank + 1.0], requires_grad=True)
    gathered = rig.all_gather(x * 1.0, sync_grads=True)
    assert gathered.shape == (2, 1)
    loss = (gathered[:, 0] * torch.tensor([1.0, 2.0])).sum()
    loss.backward()
    # every rank's loss depends on x_r with weight (r+1); the two ranks' gradients add up
    assert torch.equal(x.grad, torch.tensor([2.0 * (rank + 1)])), x.grad
    # gather_for_metrics drops the sample the sampler repeats to even out 5 samples on 2 ranks
    loader = rig.prepare(DataLoader(list(range(5)), batch_size=2))
    seen_ids = torch.cat([rig.gather_for_metrics(batch) for batch in loader])
    assert seen_ids.tolist() == [0, 1, 2, 3, 4], seen_ids
    # Two loaders whose last per-rank batches have the same size: only the padded one (7 samples)
    # loses a duplicate; the even one (10 samples), read after it, keeps all of its samples.
    even = rig.prepare(DataLoader(list(range(100, 110)), batch_size=4))
    padded = rig.prepare(DataLoader(list(range(7)), batch_size=3))
    assert torch.cat([rig.gather_for_metrics(b) for b in padded]).tolist() == list(range(7))
    assert torch.cat([rig.gather_for_metrics(b) for b in even]).tolist() == list(range(100, 110))
    # The shuffle seed is rank 0's (docs/distributed.md "Data"): ranks whose torch RNGs differ
    # still take their shares of one global order, so together they see every sample once.
    torch.manual_seed(1000 + rank)
    shuffled = rig.prepare(DataLoader(list(range(16)), batch_size=2, shuffle=True))
    order = torch.cat([rig.gather_for_metrics(b) for b in shuffled]).tolist()
    assert sorted(order) == list(range(16)) and order != list(range(16)), order
    # a result far larger than a pipe buffer (and holding a tensor) must come back whole
    return f"ok world={world}", torch.arange(1_000_000)


def main() -> None:
    strategy = sys.argv[1] if len(sys.argv) > 1 else "ddp_spawn"
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=strategy)
    summary, big = rig.launch(check)
    assert torch.equal(big, torch.arange(1_000_000)), "rank 0's large result was corrupted"
    print("result:", summary, flush=True)
    try:  # here, after the workers ended, there are no ranks to reduce with
        rig.all_reduce(torch.ones(1))
    except RuntimeError as e:
        print("after launch, in the launching process:", e, flush=True)


if __name__ == "__main__":
    main()
