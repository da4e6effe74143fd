"""A local sharded (FSDP) save of 2 gloo processes whose rank 0 dies (``os._exit``: no clean-up, as
SIGKILL) while it replaces the checkpoint ``last`` points at: once every rank's shards are written
(nothing committed), at the swap of the directories, and after the swap (the old copy not yet
removed). Then 2 new processes load ``last``: the old checkpoint or the new one, whole and exact,
never nothing; and their next save tidies what the dead save left (its temp directory holding both
ranks' shards, or the old copy), leaving only the checkpoint and ``last``.

Run by hand: ``python tests/unit/test_checkpoint_sharded_kill.py PHASE DIR [POINT]`` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Where rank 0 dies, and which checkpoint ``last`` must give after it.
POINTS = {"shards written": 1, "swap": 1, "old copy removed": 2}


def _whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": t.full_tensor() for k, t in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        out.update({f"m{i}.{k}": t.full_tensor() if hasattr(t, "full_tensor") else t.clone() for k, t in state.items()})
    return out


def _die_at(point: str) -> None:
    from torchrig.checkpoint import files, sharded

    def die(*args: object, **kwargs: object) -> None:
        os._exit(17)

    if point == "shards written":
        sharded.hash_existing = die  # rank 0 hashes DCP's files once every rank wrote its shards
    elif point == "swap":
        files.exchange = die
    else:
        files._remove_checkpoint = die  # the previous checkpoint, after the swap


def worker(phase: str, folder: Path, point: str) -> None:
    import safetensors.torch
    from test_checkpoint_distributed import build, step

    import torchrig

    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="fsdp")
    model, optimizer = build(rig)
    state = {"model": model, "optimizer": optimizer}
    if phase == "save":
        for n in (1, 2):
            step(rig, model, optimizer)
            if rig.is_global_zero:
                tensors = {k: v.contiguous() for k, v in _whole(model, optimizer).items()}
                safetensors.torch.save_file(tensors, str(folder / f"step-{n}.safetensors"))
            else:
                _whole(model, optimizer)  # the gathers are collective
            if n == 2 and rig.is_global_zero:
                _die_at(point)
            rig.save(folder / "ckpts" / "ck", {**state, "step": n})
        return
    step_loaded = rig.load(folder / "ckpts" / "last", state)["step"]
    loaded = _whole(model, optimizer)
    if rig.is_global_zero:
        saved = safetensors.torch.load_file(str(folder / f"step-{step_loaded}.safetensors"))
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
        (folder / "loaded.txt").write_text(str(step_loaded))
    rig.save(folder / "ckpts" / "ck", {**state, "step": 3})
    if rig.is_global_zero:
        (folder / "after.txt").write_text(" ".join(sorted(os.listdir(folder / "ckpts"))))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(100)
@pytest.mark.parametrize("point", list(POINTS))
def test_rank_0_killed_while_a_sharded_save_replaces_last_loses_nothing(tmp_path: Path, point: str) -> None:
    from test_checkpoint_distributed import launch

    results = launch("save", tmp_path, script=__file__, extra_env={"KILL_POINT": point}, check=False)
    assert results[0][0] == 17, results[0][1][-3000:]  # rank 0 died where it was told to
    launch("load", tmp_path, script=__file__)
    assert int((tmp_path / "loaded.txt").read_text()) == POINTS[point]
    assert (tmp_path / "after.txt").read_text() == "ck last"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    base = Path(sys.argv[2])
    worker(sys.argv[1], base, os.environ.get("KILL_POINT", ""))
