"""One training, the model built in the calling process, gives the same weights on every process
layout: ``ddp``, ``ddp_spawn``, ``ddp_notebook``, ``Rig.launch`` and one process with the same
global batch; and ``ddp_spawn`` gives the same weights run after run (issue 15, item 1: spawned
workers used to share one copy of the parameters through shared memory)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_helpers import SCRIPTS, explain, run

import torchrig
from conftest import printed_json

RUNS = 3


def _weights(args: list[str]) -> list[dict[str, Any]]:
    proc = run([str(SCRIPTS / "layouts.py"), *args], timeout=110)
    assert proc.returncode == 0, explain(proc)
    return printed_json(proc.stdout)


def _assert_close(got: list[float], expected: list[float], what: str) -> None:
    a, b = torch.tensor(got), torch.tensor(expected)
    assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"{what}: largest difference {(a - b).abs().max():.3g}"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_layout_trains_the_same_weights_as_one_process() -> None:
    results = _weights(["launched", str(RUNS)]) + _weights(["ddp"])
    by_layout: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_layout.setdefault(r["layout"], []).append(r)
    assert {k: len(v) for k, v in by_layout.items()} == {
        "initial": 1,
        "one process": 1,
        "ddp_notebook": 1,
        "Rig.launch": 1,
        "ddp_spawn": RUNS,
        "ddp": 1,
    }
    initial = by_layout.pop("initial")[0]["weights"]
    reference = by_layout.pop("one process")[0]["weights"]
    assert not torch.allclose(torch.tensor(reference), torch.tensor(initial), atol=1e-3)  # it trained
    for layout, runs in by_layout.items():
        for i, r in enumerate(runs):
            _assert_close(r["weights"], reference, f"{layout} (run {i + 1} of {len(runs)})")
    launched = by_layout["Rig.launch"][0]
    assert launched["ranks_agree"], "the two ranks of Rig.launch ended with different weights"
    assert not launched["shared"], "a spawned worker's parameters are in shared memory"
    spawned = [r["weights"] for r in by_layout["ddp_spawn"]]
    assert all(w == spawned[0] for w in spawned), "ddp_spawn gave different weights in different runs"


def _train(rig: torchrig.Rig, module: torch.nn.Module) -> None:
    raise AssertionError("never called: the arguments cannot be sent")


def test_ddp_spawn_with_an_unpicklable_argument_says_why_before_starting() -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp_spawn")
    with pytest.raises(TypeError, match=r"sends the function's arguments .* one of them cannot be pickled"):
        rig.launch(_train, lambda: None)


def test_what_spawn_sends_holds_copies_of_the_tensors() -> None:
    import pickle

    from torchrig.strategies.launch import _pickled

    module = torch.nn.Linear(2, 1)
    fn, args, kwargs = pickle.loads(_pickled(_train, (module,), {"w": module.weight}))
    assert fn is _train and not module.weight.is_shared()  # the caller's tensors stay where they were
    sent = args[0].weight
    assert torch.equal(sent, module.weight) and sent.data_ptr() != module.weight.data_ptr()
    assert not sent.is_shared()  # a copy per worker: nothing to share
    assert kwargs["w"] is sent  # one object stays one object (an optimizer keeps the module's parameters)
