"""benchmarks/gpu_fp8.py: its data can be learned (so "the loss after 200 steps" compares
something), its part-2 labels name the sizes they try, and ``--smoke`` runs both parts on the CPU."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_fp8  # noqa: E402
import gpu_session  # noqa: E402
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


def test_delay_reads_a_curve_shifted_in_steps_as_that_many_steps() -> None:
    base = [3.0 + 7.0 * math.exp(-i / 40) for i in range(200)]
    later = [base[0]] * 7 + base[:-7]  # the same curve, 7 steps late
    assert gpu_fp8.delay(base, later) == pytest.approx(7.0, abs=0.05)
    assert gpu_fp8.delay(later, base) == pytest.approx(-7.0, abs=0.05)
    assert gpu_fp8.delay(base, base) == 0.0
    assert gpu_fp8.delay(base, [10.0] * 200) == math.inf  # never gets there
    with pytest.raises(ValueError, match=r"delay needs curves longer than the window \(10 steps\); got 6 steps"):
        gpu_fp8.delay(base[:6], base[:6])


def test_take_turns_begins_no_round_that_would_end_past_the_deadline() -> None:
    now = [0.0]

    def contender(name: str, seconds_per_step: float) -> gpu_fp8.Contender:
        def run(steps: int) -> float:
            now[0] += seconds_per_step * steps
            order.append(name)
            return seconds_per_step * steps

        return gpu_fp8.Contender(name, run, [])

    order: list[str] = []
    a, b = contender("a", 1.0), contender("b", 2.0)
    # A round of 2 steps takes 6 s: rounds end at 6, 12, 18; the 4th would end at 24 > 20.
    seconds, done = gpu_fp8.take_turns([a, b], rounds=10, per_round=2, deadline=20.0, clock=lambda: now[0])
    assert done == 3 and seconds == {"a": [2.0] * 3, "b": [4.0] * 3}
    assert order == ["a", "b", "b", "a", "a", "b"]  # the order rotates each round
    order.clear()
    seconds, done = gpu_fp8.take_turns([a, b], rounds=2, per_round=2, deadline=math.inf, clock=lambda: now[0])
    assert done == 2 and order == ["a", "b", "b", "a"]


def _fp8(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_fp8.py"), "--smoke", "--markdown", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_part1_refuses_an_unknown_contender_and_skips_every_contender_past_its_budget() -> None:
    done = _fp8("--contenders", "bf16,fp4")
    assert done.returncode != 0
    choice = "a comma-separated choice of bf16, tensorwise, rowwise, tensorwise-exact"
    assert f"--contenders 'bf16,fp4': {choice}" in done.stderr
    done = _fp8("--contenders", "bf16,tensorwise", "--budget", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("32-true", "fp8-mixed, tensorwise"):
        assert f"{name}: skipped: the --budget of 0 s was spent before its warm-up" in done.stdout
        assert f"| {name} | failed | skipped: the --budget of 0 s was spent" in done.stdout
    assert "0 rounds of 2 taking turns" in done.stdout


def test_a_session_part_past_its_budget_is_stopped_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(120)"
    )
    part = gpu_session.Part("hangs", [sys.executable, "-c", hang], budget=5)
    start = time.perf_counter()
    line = gpu_session.run_part(part, budget=5)
    assert time.perf_counter() - start < 30
    assert line == "[hangs] STOPPED at its budget of 5 s; the rest of this part is skipped"
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # the whole process group was killed, not only the child
        if not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the part's own child {grandchild} still runs")


def test_a_session_skips_the_parts_its_total_budget_leaves_no_time_for() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_session.py"), "--smoke", "--total-budget", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for label in ("tests/gpu", "1B model, longer", "width 4096"):
        assert f"[{label}] SKIPPED: 10 s of the --total-budget left" in done.stdout
    assert "session: 0 s of 10" in done.stdout


@pytest.mark.slow  # the whole session, tiny, on the CPU: about a minute
@pytest.mark.timeout(240)
def test_session_smoke_runs_every_part_within_its_budget() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_session.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^\[tests/gpu\] exit code [05] after \d+ s \(budget 60 s\)$", out, re.M), out  # 5: all skipped
    for label in ("1B model, longer", "width 4096"):
        assert re.search(rf"^\[{label}\] exit code 0 after \d+ s \(budget 90 s\)$", out, re.M), out
    one_b = out[out.index("=== 1B model, longer") : out.index("=== width 4096")]
    exact = "fp8-mixed, tensorwise, exact fwd accum"
    for name in ("32-true", "fp8-mixed, tensorwise", "fp8-mixed, rowwise", exact):
        assert re.search(rf"^\| {name} \| [\d,]+ \| ", one_b, re.M), one_b
    assert "--contenders bf16,tensorwise,rowwise,tensorwise-exact --total 6" in one_b
    wide = out[out.index("=== width 4096") :]
    assert "| fp8-mixed, rowwise |" not in wide
    for name in ("fp8-mixed, tensorwise", exact):
        assert re.search(rf"^\| {name} \| [\d,]+ \| ", wide, re.M), wide
    assert "--contenders bf16,tensorwise,tensorwise-exact --dim 128 --heads 8" in wide


def test_the_cpu_study_trains_bf16_against_emulated_float8_from_the_same_start(tmp_path: Path) -> None:
    curves = tmp_path / "curves.json"
    tiny = ["--dim", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "2"]
    tiny += ["--steps", "12", "--seeds", "0", "--variants", "bf16,tensorwise:mlp", "--curves", str(curves)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fp8_cpu_study.py"), "--markdown", *tiny],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU, float8 EMULATED (torchao emulate=True): 1 blocks x width 32 (hidden 96, 2 heads)" in done.stdout
    assert re.search(r"^\| bf16 \| [\d.]+ \| \+0\.00% \| \+0\.00% \| \+0\.0 \|$", done.stdout, re.M), done.stdout
    assert re.search(r"^\| tensorwise:mlp \| [\d.]+ \| [+-]\d+\.\d+% \| [+-]\d+\.\d+% \| ", done.stdout, re.M)
    saved = json.loads(curves.read_text())["curves"]
    assert len(saved["bf16"][0]) == len(saved["tensorwise:mlp"][0]) == 12
    assert saved["bf16"][0][0] == pytest.approx(saved["tensorwise:mlp"][0][0], rel=0.01)  # the same start
    assert saved["bf16"][0] != saved["tensorwise:mlp"][0]  # float8 rounding changed the trajectory
    bad = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fp8_cpu_study.py"), "--variants", "tensorwise"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "--variants must start with bf16 and name only bf16, 32-true" in bad.stderr
