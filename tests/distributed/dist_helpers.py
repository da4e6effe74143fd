"""Running the scripts in ``scripts/`` as real processes, and the 1-process reference run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SCRIPTS = Path(__file__).parent / "scripts"
SRC = Path(__file__).resolve().parents[2] / "src"


def env() -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import python_env

    out = python_env()
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS"):
        out.pop(var, None)
    return out


def run(args: list[str], *, timeout: float = 100, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with torchrig importable; never longer than ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, *args], env=env(), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"torchrig_test_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def reference_weights() -> dict[str, torch.Tensor]:
    """The final weights of ``scripts/train.py`` in one process (same global batches)."""
    import torchrig

    state, _ = load_script("train").train(torchrig.Rig(accelerator="cpu"))
    return {k: v.clone() for k, v in state.items()}


def result(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return torch.load(out), json.loads(Path(str(out) + ".json").read_text())


def assert_matches_reference(weights: dict[str, torch.Tensor]) -> None:
    ref = reference_weights()
    assert sorted(weights) == sorted(ref)
    for key, value in ref.items():
        assert torch.allclose(weights[key], value, atol=1e-5, rtol=1e-5), (key, (weights[key] - value).abs().max())


def same_weights(a: Path, b: Path) -> None:
    """The two saved state dicts are bitwise equal."""
    wa, wb = torch.load(a), torch.load(b)
    assert sorted(wa) == sorted(wb)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def torchrig_run_fit(tmp: Path, *extra: str, timeout: float = 100) -> Path:
    """``torchrig run --devices 2`` (torchrun) of ``scripts/preempt_fit.py``, never interrupted:
    the weights other launchers must match. Returns the saved weights' path."""
    out = tmp / "torchrun.pt"
    args = ["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", str(SCRIPTS / "preempt_fit.py")]
    done = run([*args, str(tmp / "torchrun"), str(out), *extra], timeout=timeout)
    assert done.returncode == 0, explain(done)
    assert "rank 0 of 2 launched by torchrun" in done.stdout, explain(done)
    return out


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
