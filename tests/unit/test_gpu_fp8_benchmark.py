"""benchmarks/gpu_fp8.py: its data can be learned (so "the loss after 200 steps" compares
something), its part-2 labels name the sizes they try, and ``--smoke`` runs both parts on the CPU."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_fp8  # noqa: E402
import gpu_transformer  # noqa: E402


def test_tokens_follow_a_permutation_but_for_the_noise_share() -> None:
    cfg = gpu_transformer.SMOKE
    rows = gpu_fp8.structured_tokens(cfg, 64)
    assert rows.shape == (64, cfg.seq + 1) and rows.dtype == torch.long
    assert torch.equal(rows, gpu_fp8.structured_tokens(cfg, 64))  # the same batches for every contender
    # The most frequent successor of each token is its permutation image: about 1 - NOISE of pairs.
    pairs = rows[:, :-1] * cfg.vocab + rows[:, 1:]
    counts = torch.bincount(pairs.flatten(), minlength=cfg.vocab**2).view(cfg.vocab, cfg.vocab)
    followed = counts.max(dim=1).values.sum().item() / pairs.numel()
    assert abs(followed - (1 - gpu_fp8.NOISE)) < 0.05, followed
    # A learner that knows the permutation reaches ~NOISE * ln(vocab) + the entropy of the coin, far
    # below the ln(vocab) of random tokens.
    assert gpu_fp8.NOISE * math.log(cfg.vocab) + 0.6 < 0.5 * math.log(cfg.vocab)


def test_each_large_candidate_is_named_by_its_parameter_count() -> None:
    sizes = []
    for label, cfg in gpu_fp8.LARGE:
        with torch.device("meta"):
            params = sum(p.numel() for p in gpu_transformer.Transformer(cfg).parameters())
        assert label == f"{params / 1e9:.1f}B"
        sizes.append(params)
    assert sizes == sorted(sizes, reverse=True)  # largest first: the first that trains is the answer


def _smoke(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_fp8.py"), "--smoke", "--markdown", *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # three models of two blocks, six steps each, on one CPU thread
@pytest.mark.timeout(180)
def test_smoke_part1_trains_every_precision_on_the_same_batches() -> None:
    out = _smoke()
    assert "SMOKE (a check, not a measurement)" in out and "6 steps each (2 warm-up, then 2 rounds of 2" in out
    first_losses = []
    for name in ("32-true", "fp8-mixed, tensorwise", "fp8-mixed, rowwise"):
        row = re.search(
            rf"^\| {name} \| ([\d,]+) \| (\d+\.\d+)x[^|]* \| n/a \| ([\d.]+) \| ([\d.]+) \(([+-]\d+\.\d+)%\)", out, re.M
        )
        assert row is not None, out
        first_losses.append(float(row.group(3)))
        assert abs(float(row.group(5))) < 1.0  # fp8 stays near fp32 over six steps of a tiny model
    assert max(first_losses) - min(first_losses) < 0.01  # the same initial weights and batch
    assert "command: python benchmarks/gpu_fp8.py --smoke --markdown" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_smoke_part2_reports_the_first_candidate_that_trains() -> None:
    out = _smoke("--largest")
    assert re.search(
        r"^\| smoke-wide \| 0\.00B \| 3 x 64 \(hidden 176\) \| [\d,]+ \| [\d.]+ \| n/a \| n/a \|$", out, re.M
    )
    assert "| smoke |" not in out  # the smaller candidate is not tried once the wider one trains
