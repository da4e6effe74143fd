"""Every collective on 2 processes (ddp_spawn and ddp_notebook), and for free in one process."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import SCRIPTS, explain, run
from torch.utils.data import DataLoader

import torchrig


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_collective_on_two_spawned_processes() -> None:
    # The script asserts on every rank (all_gather incl. sync_grads gradients, all_reduce ops,
    # broadcast of tensors and objects, barrier, reduce_boolean_decision, rank_zero_first,
    # gather_for_metrics) and rig.launch returns rank 0's result.
    proc = run([str(SCRIPTS / "collectives.py"), "ddp_spawn"])
    assert proc.returncode == 0, explain(proc)
    assert "result: ok world=2" in proc.stdout, explain(proc)
    # the launching process is none of the ranks: a collective there is refused, not answered alone
    assert (
        "after launch, in the launching process: the collective all_reduce needs the processes that "
        "DDPStrategy(start_method='spawn') (ddp_spawn, ddp_notebook) starts in rig.launch(fn): put the training "
        "in a function fn(rig, ...)"
    ) in proc.stdout, explain(proc)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_collective_on_two_forked_processes() -> None:
    proc = run([str(SCRIPTS / "collectives.py"), "ddp_notebook"])
    assert proc.returncode == 0, explain(proc)
    assert "result: ok world=2" in proc.stdout, explain(proc)


@pytest.mark.timeout(10)
def test_collectives_are_identities_in_one_process() -> None:
    rig = torchrig.Rig(accelerator="cpu")
    t = torch.arange(3.0)
    assert torch.equal(rig.all_gather({"t": t})["t"], t.unsqueeze(0))
    assert rig.all_reduce(t, op="max") is t
    assert rig.broadcast({"a": 1}) == {"a": 1}
    assert rig.reduce_boolean_decision(False) is False
    rig.barrier("nothing to wait for")
    with rig.rank_zero_first():
        pass
    loader = rig.prepare(DataLoader(list(range(5)), batch_size=2))
    assert torch.cat([rig.gather_for_metrics(b) for b in loader]).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"all_reduce\(op='avg'\) is not a reduction; use one of mean, sum"):
        rig.all_reduce(t, op="avg")
