"""A local sharded (FSDP) checkpoint whose shard one rank reads is damaged: each rank checks only
the shard files its own read plan names, so the other rank never sees the damage itself, yet both
refuse the load (DCP gathers every rank's plan, and the check runs as each rank plans, before any
rank reads), naming the damaged file, with no weight or moment changed on either rank. The ranks
never disagree (one loading while the other raises). Ranks that find different checkpoints at the
path they were given (another process saved there between their looks: ``last`` moved, a name was
replaced) are refused together the same way, instead of each filling its shards from its own
checkpoint: each rank's read plan carries a digest of the ``meta.json`` it found. Here that race is
made certain: rank 0 is given one checkpoint, rank 1 another. 2 gloo processes.

Run by hand: ``python tests/unit/test_checkpoint_damaged_shard.py PHASE DIR`` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


def _whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.full_tensor() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [t.full_tensor() if hasattr(t, "full_tensor") else t.clone() for t in state.values()]
    return tensors


def worker(phase: str, folder: Path) -> None:
    from test_checkpoint_distributed import build, step

    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="fsdp")
    model, optimizer = build(rig)
    step(rig, model, optimizer)
    if phase.startswith("save"):
        rig.save(folder / "ck", {"model": model, "optimizer": optimizer, "step": 1})
        if phase == "save-two":
            step(rig, model, optimizer)
            rig.save(folder / "other", {"model": model, "optimizer": optimizer, "step": 2})
        return
    step(rig, model, optimizer)  # other weights than the checkpoints'
    step(rig, model, optimizer)
    before = _whole(model, optimizer)
    given = "last" if phase == "load" else ("ck" if rig.global_rank == 0 else "other")
    try:
        rig.load(folder / given, {"model": model, "optimizer": optimizer})
        outcome = "loaded"
    except torchrig.checkpoint.CheckpointError as err:
        outcome = str(err)
    (folder / f"outcome-{rig.global_rank}.txt").write_text(outcome)
    assert all(torch.equal(a, b) for a, b in zip(before, _whole(model, optimizer), strict=True)), "changed"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(120)
def test_a_shard_only_the_other_rank_reads_is_refused_on_both_ranks(tmp_path: Path) -> None:
    from test_checkpoint_distributed import launch

    launch("save", tmp_path, script=__file__)
    shard = tmp_path / "ck" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only its SHA-256 tells
    shard.write_bytes(bytes(data))
    launch("load", tmp_path, script=__file__)
    for rank in (0, 1):
        outcome = (tmp_path / f"outcome-{rank}.txt").read_text()
        assert outcome.startswith(f"checksum mismatch in {shard}: SHA-256 is "), (rank, outcome)
        assert "meta.json says" in outcome and "refusing to load it" in outcome, (rank, outcome)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(120)
def test_ranks_that_find_different_checkpoints_are_refused_together(tmp_path: Path) -> None:
    from test_checkpoint_distributed import launch

    launch("save-two", tmp_path, script=__file__)
    launch("mixed", tmp_path, script=__file__)
    for rank in (0, 1):
        outcome = (tmp_path / f"outcome-{rank}.txt").read_text()
        assert outcome.startswith(f"the ranks found different checkpoints at {tmp_path / 'ck'} (ranks [0] one "), (
            rank,
            outcome,
        )
        assert outcome.endswith(
            "another process saved there while they loaded it; nothing was loaded on any rank: load it again"
        ), (rank, outcome)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(sys.argv[1], Path(sys.argv[2]))
