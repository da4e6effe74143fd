"""compile= and activation_checkpointing= on 2 real processes (gloo): DDP and FSDP train like
one eager process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import SCRIPTS, explain, load_script, result, run

import torchrig

pytestmark = pytest.mark.distributed


def _reference() -> dict[str, torch.Tensor]:
    """One eager process, no checkpointing, on the same global batches."""
    script = load_script("speedups")
    _, state = script.train(torchrig.Rig(accelerator="cpu"))
    return state


def _run(tmp_path: Path, *args: str) -> tuple[dict[str, torch.Tensor], int]:
    out = tmp_path / "w.pt"
    proc = run([str(SCRIPTS / "speedups.py"), "--out", str(out), *args], timeout=240)
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    return weights, info["graphs"]


def _assert_same(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert list(weights) == list(reference)  # the plain keys: nothing compiled or checkpointed shows
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.timeout(120)
def test_fsdp_with_activation_checkpointing_trains_like_one_eager_process(tmp_path: Path) -> None:
    weights, _ = _run(tmp_path, "--strategy", "fsdp", "--ac", "full")
    _assert_same(weights, _reference())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_regional_compile_trains_like_one_eager_process(tmp_path: Path) -> None:
    weights, graphs = _run(tmp_path, "--strategy", "ddp", "--compile", "regional")
    assert graphs >= 1  # the blocks did run compiled
    _assert_same(weights, _reference())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_regional_compile_and_checkpointing_train_like_one_eager_process(tmp_path: Path) -> None:
    weights, graphs = _run(tmp_path, "--strategy", "fsdp", "--compile", "regional", "--ac", "full")
    assert graphs >= 1
    _assert_same(weights, _reference())
