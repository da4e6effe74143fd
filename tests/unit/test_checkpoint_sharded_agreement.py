"""The ranks of a sharded (FSDP) load that find different checkpoints at the path they were given
(another process saved there between their looks: ``last`` moved, a name was replaced) are refused
together, before any rank reads a shard, instead of each filling its shards from its own checkpoint:
every rank's DCP read plan carries a digest of the ``meta.json`` it found, compared where DCP
gathers the plans. Here the race is made certain: rank 0 is given one checkpoint, rank 1 another.
2 gloo processes.

Run by hand: ``python tests/unit/test_checkpoint_sharded_agreement.py PHASE DIR`` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


def worker(phase: str, folder: Path) -> None:
    from test_checkpoint_damaged_shard import _whole
    from test_checkpoint_distributed import build, step

    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="fsdp")
    model, optimizer = build(rig)
    step(rig, model, optimizer)
    if phase == "save":
        rig.save(folder / "a", {"model": model, "optimizer": optimizer, "step": 1})
        step(rig, model, optimizer)
        rig.save(folder / "b", {"model": model, "optimizer": optimizer, "step": 2})
        return
    step(rig, model, optimizer)
    step(rig, model, optimizer)
    before = _whole(model, optimizer)
    try:
        rig.load(folder / ("a" if rig.global_rank == 0 else "b"), {"model": model, "optimizer": optimizer})
        outcome = "loaded"
    except torchrig.checkpoint.CheckpointError as err:
        outcome = str(err)
    (folder / f"outcome-{rig.global_rank}.txt").write_text(outcome)
    assert all(torch.equal(a, b) for a, b in zip(before, _whole(model, optimizer), strict=True)), "changed"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(120)
def test_ranks_that_find_different_checkpoints_are_refused_together(tmp_path: Path) -> None:
    from test_checkpoint_distributed import launch

    launch("save", tmp_path, script=__file__)
    launch("load", tmp_path, script=__file__)
    for rank in (0, 1):
        outcome = (tmp_path / f"outcome-{rank}.txt").read_text()
        assert outcome.startswith(f"the ranks found different checkpoints at {tmp_path / 'a'} (ranks [0] one "), (
            rank,
            outcome,
        )
        assert outcome.endswith(
            "another process saved there while they loaded it; nothing was loaded on any rank: load it again"
        ), (rank, outcome)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(sys.argv[1], Path(sys.argv[2]))
