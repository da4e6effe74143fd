"""benchmarks/gpu_transformer.py: its FLOP count is the textbook one, and ``--smoke`` runs all
three contenders (hand-written FSDP2 loop, Rig, Trainer) on the CPU and prints the table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_transformer  # noqa: E402


@pytest.mark.parametrize("cfg", [gpu_transformer.SMOKE, gpu_transformer.Config()], ids=["smoke", "1B"])
def test_flops_per_step_are_six_per_matmul_parameter_per_token_plus_attention(cfg: gpu_transformer.Config) -> None:
    """6 x (parameters in matrix products) x tokens, plus 12 x layers x width x sequence x tokens for
    the attention scores and their use (forward and backward, the full square: no causal halving).
    The embedding is a lookup (no FLOPs), the norms element-wise."""
    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in gpu_transformer.Transformer(cfg).parameters())
    matmul_params = params - cfg.vocab * cfg.dim - (2 * cfg.layers + 1) * cfg.dim
    tokens = cfg.batch * cfg.seq
    expected = 6 * matmul_params * tokens + 12 * cfg.layers * cfg.dim * cfg.seq * tokens
    assert gpu_transformer.flops_per_step(cfg) == expected
    if cfg == gpu_transformer.Config():
        assert 1.0e9 < params < 1.1e9  # "about 1B"


@pytest.mark.slow  # every contender once: 3.6 s of CPU (measured on the shared 2-core machine)
@pytest.mark.timeout(180)
def test_smoke_runs_every_contender_on_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_transformer.py"), "--smoke", "--markdown"],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "SMOKE (a check, not a measurement)" in out and "1 x cpu, fsdp, 32-true, compile=False" in out
    for contender in ("hand-written", "Rig", "Trainer"):
        row = re.search(rf"^\| {contender} \| ([\d,]+) \| (\d+\.\d+)x[^|]* \| n/a \|$", out, re.M)
        assert row is not None, out
        assert int(row.group(1).replace(",", "")) > 0
    assert re.search(r"^\| hand-written \| [\d,]+ \| 1\.000x \| n/a \|$", out, re.M)
    monitor = re.search(r"ThroughputMonitor's last window in the Trainer: no MFU .*, ([\d.e+-]+) TFLOP/s", out)
    assert monitor is not None and float(monitor.group(1)) > 0
    assert "command: python benchmarks/gpu_transformer.py --smoke --markdown" in out
