"""A save to object storage that fails says whether its checkpoint was committed, as a local save
does, and a failure after the commit (the ``last`` object, removing what it replaced or what
``keep_last`` drops) never deletes the committed checkpoint: whole and sharded (FSDP in one
process), on fsspec's in-memory store.

The save used to delete its own committed version on any error after its ``meta.json`` (the
clean-up of a failed upload ran for it too): replacing ``ck`` with ``keep_last``, a delete that
failed once left neither the old ``ck`` (already removed) nor the new one, and ``last`` pointing at
nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

import torchrig
from torchrig.checkpoint import CheckpointError

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(90)]  # FSDP in one process


@pytest.fixture(params=["auto", "fsdp"])  # whole checkpoints, and sharded ones through DCP
def run(request: pytest.FixtureRequest) -> tuple[torchrig.Rig, dict[str, Any]]:
    """A rig of each strategy and the state of a small model and its AdamW after one step."""
    rig = torchrig.Rig(accelerator="cpu", strategy=request.param)
    torch.manual_seed(0)
    model = rig.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    rig.backward(model(torch.randn(3, 4)).square().mean())
    optimizer.step()
    return rig, {"model": model, "optimizer": optimizer}


def _fail(monkeypatch: pytest.MonkeyPatch, method: str, where: str, error: Exception) -> None:
    """Make ``MemoryFileSystem.<method>`` raise ``error`` for paths containing ``where``."""
    real = getattr(MemoryFileSystem, method)

    def failing(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if where in str(path) or (args and where in str(args[0])):
            raise error
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, method, failing)


def _refused(
    monkeypatch: pytest.MonkeyPatch, failing: tuple[str, str, Exception], rig: torchrig.Rig, url: str, **kwargs: Any
) -> str:
    """What ``rig.save(url, **kwargs)`` raises while ``failing`` (method, path part, error) fails."""
    with monkeypatch.context() as m:
        _fail(m, *failing)
        with pytest.raises(CheckpointError) as err:
            rig.save(url, **kwargs)
    return str(err.value)


def test_a_delete_failing_after_the_commit_keeps_the_new_checkpoint(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, run: tuple[torchrig.Rig, dict[str, Any]]
) -> None:
    rig, state = run
    rig.save(f"{memory_url}/old", {**state, "step": 0})
    rig.save(f"{memory_url}/ck", {**state, "step": 1})
    failing = ("rm_file", "/old/", ConnectionError("503 SlowDown"))  # keep_last=1 drops 'old': it fails once
    message = _refused(monkeypatch, failing, rig, f"{memory_url}/ck", state={**state, "step": 2}, keep_last=1)
    assert rig.load(f"{memory_url}/last", state)["step"] == 2  # the new one, not nothing
    assert message == (
        f"the checkpoint {memory_url}/ck was committed and the 'last' link points at it, but removing older "
        "checkpoints (keep_last=1) failed (ConnectionError: 503 SlowDown); the next save tries again"
    )
    rig.save(f"{memory_url}/ck", {**state, "step": 3}, keep_last=1)  # the next save tries again
    names = sorted(
        p.rsplit("/", 1)[-1] for p in MemoryFileSystem().ls(memory_url.removeprefix("memory://"), detail=False)
    )
    assert names == ["ck", "last"]
    assert rig.load(f"{memory_url}/last", state)["step"] == 3


def test_a_link_write_failing_after_the_commit_says_where_the_link_points(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, run: tuple[torchrig.Rig, dict[str, Any]]
) -> None:
    rig, state = run
    rig.save(f"{memory_url}/step-1", {**state, "step": 1})
    failing = ("pipe_file", "/last", PermissionError("AccessDenied"))
    message = _refused(monkeypatch, failing, rig, f"{memory_url}/step-2", state={**state, "step": 2})
    assert message == (
        f"the checkpoint {memory_url}/step-2 was committed, but the 'last' link was not moved to it "
        f"(PermissionError: AccessDenied); {memory_url}/last still points at 'step-1'. Load {memory_url}/step-2 by "
        "its name; the next save moves the link"
    )
    assert rig.load(f"{memory_url}/step-2", state)["step"] == 2
    assert rig.load(f"{memory_url}/last", state)["step"] == 1


def test_an_upload_failing_before_the_commit_says_nothing_was_replaced(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, run: tuple[torchrig.Rig, dict[str, Any]]
) -> None:
    rig, state = run
    rig.save(f"{memory_url}/ck", {**state, "step": 1})
    before = sorted(MemoryFileSystem().find(memory_url.removeprefix("memory://")))
    failing = ("put_file", "/state.pt", ConnectionError("connection reset by peer"))
    message = _refused(monkeypatch, failing, rig, f"{memory_url}/ck", state={**state, "step": 2})
    assert message == (
        f"saving {memory_url}/ck failed before the checkpoint was committed (ConnectionError: connection reset by "
        "peer); nothing was replaced (the previous checkpoint and the link are as they were)"
    )
    assert sorted(MemoryFileSystem().find(memory_url.removeprefix("memory://"))) == before  # nothing of it left
    assert rig.load(f"{memory_url}/last", state)["step"] == 1
