"""float8 against bf16 on one GPU, and the largest model of the family that trains there.

    python benchmarks/gpu_fp8.py                     # bf16-mixed vs fp8-mixed (tensorwise, rowwise), 200 steps
    python benchmarks/gpu_fp8.py --total 320 --contenders bf16,tensorwise --budget 240
    python benchmarks/gpu_fp8.py --largest           # the largest model that trains (FSDP2, full AC)
    python benchmarks/gpu_fp8.py --smoke             # tiny, on the CPU (< 1 min): a check that it runs
    python benchmarks/gpu_fp8.py --largest --smoke

**Part 1** (issue 32's target: fp8-mixed at least 1.2x bf16-mixed tokens/s on the 1B model, loss
after 200 steps within 1%). The model of ``benchmarks/gpu_transformer.py`` (1.06B parameters,
sequence 2048, 4 sequences a step) is trained three times through ``Rig`` on the same batches, from
the same initial weights: ``precision="bf16-mixed"``, ``precision=FP8Mixed()`` (torchao's default
recipe, tensorwise dynamic scaling) and ``FP8Mixed(config=Float8LinearConfig.from_recipe_name("rowwise"))``,
each with ``compile=True`` and FSDP2 (one shard per block, as ``gpu_transformer.py``). The three
take turns: after ``--warmup`` steps each (compilation), rounds of ``--steps`` optimizer steps
alternate between them (the order rotates each round), until each has taken ``--total`` steps.
Tokens/s is the median over rounds; the ratio is the median of the per-round ratios to bf16's
(with a 95% interval). The data are not random tokens (a model cannot learn those, and every loss
would sit at ln(vocab)): each token follows its predecessor through a fixed random permutation of
the vocabulary, except a ``NOISE`` share drawn at random, so the loss falls from ~10.4 towards its
floor (~3.2) and "the loss after 200 steps" says something. The loss compared is the mean over the
last 10 steps and over the last 50 (the same batches for every contender), and the *delay*: how many
steps later than the first contender a contender's loss curve (smoothed over 10 steps) reaches the
first's loss 10 steps before the end (``delay``): while the loss still falls fast, a gap of a few
percent at a fixed step can be a delay of a few steps. ``--contenders`` picks and orders them (keys
of ``precisions()``); ``--budget SECONDS`` bounds part 1: no contender is built and no round begun
past it (a round is not begun that would end past it), and the table shows what was taken, so a
slow compilation costs rounds, not the table (``benchmarks/gpu_session.py`` runs it so).

**Part 2** (``--largest``): models of the same family, widest first (``LARGE``), are tried one at a
time, each in a child process (an out-of-memory error leaves nothing behind), with ``Rig(strategy=
FSDPStrategy, activation_checkpointing="full", compile="regional", precision="bf16-mixed")`` and a
fused AdamW (no whole-model temporaries); the first that takes ``--large-steps`` steps is reported
with its tokens/s and MFU (FLOPs of the model's forward and backward, the recomputation by
activation checkpointing not counted, as MFU is usually reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment_line, median_interval, print_table
from gpu_transformer import SMOKE, Block, Config, Transformer, flops_per_step, init_group, loss_of

import torchrig
from torchrig.trainer.throughput import device_peak_flops

#: The share of tokens drawn at random instead of from the permutation (sets the loss floor).
NOISE = 0.25
#: Steps the loss curves are smoothed over to compare them (the mean of the last 10 steps, the delay).
WINDOW = 10
#: Part 2's candidates, largest first: (name, config). 16 bytes a parameter stay on the GPU
#: (fp32 weights, gradients, AdamW's two moments): 134 GB at 8.4B, 108 GB at 6.7B.
LARGE = [
    ("8.4B", Config(dim=4096, layers=40, heads=32, hidden=11008)),
    ("7.5B", Config(dim=4096, layers=36, heads=32, hidden=11008)),
    ("6.7B", Config(dim=4096, layers=32, heads=32, hidden=11008)),
    ("5.1B", Config(dim=4096, layers=24, heads=32, hidden=11008)),
    ("3.4B", Config(dim=3072, layers=28, heads=24, hidden=8192)),
    ("1.1B", Config()),
]
SMOKE_LARGE = [("smoke-wide", dataclasses.replace(SMOKE, layers=3)), ("smoke", SMOKE)]


def structured_tokens(cfg: Config, sequences: int, seed: int = 0) -> torch.Tensor:
    """``sequences`` rows of ``seq + 1`` tokens: token t+1 = perm[token t], or random (``NOISE``)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cfg.vocab, generator=g)
    rows = torch.empty(sequences, cfg.seq + 1, dtype=torch.long)
    rows[:, 0] = torch.randint(0, cfg.vocab, (sequences,), generator=g)
    noise = torch.rand(sequences, cfg.seq + 1, generator=g) < NOISE
    random = torch.randint(0, cfg.vocab, (sequences, cfg.seq + 1), generator=g)
    for t in range(1, cfg.seq + 1):
        rows[:, t] = torch.where(noise[:, t], random[:, t], perm[rows[:, t - 1]])
    return rows


def precisions(emulate: bool = False) -> dict[str, tuple[str, Any]]:
    """The contenders of part 1: a key (``--contenders``) -> (the name shown, the ``precision=``
    argument). ``emulate``: torchao's float8 emulated (``Float8LinearConfig(emulate=True)``)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    def recipe(name: str) -> Any:
        return dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=emulate)

    # The forward's float8 matmul with exact accumulation (torchao's recipes use the GPU's fast,
    # less precise one there): the one float8 numerics a CPU emulation cannot show.
    exact = dataclasses.replace(recipe("tensorwise"), gemm_config_output=Float8GemmConfig(use_fast_accum=False))
    return {
        "bf16": ("bf16-mixed", "bf16-mixed"),
        "tensorwise": ("fp8-mixed, tensorwise", torchrig.FP8Mixed(config=recipe("tensorwise"))),
        "rowwise": ("fp8-mixed, rowwise", torchrig.FP8Mixed(config=recipe("rowwise"))),
        "tensorwise-exact": ("fp8-mixed, tensorwise, exact fwd accum", torchrig.FP8Mixed(config=exact)),
    }


def smooth(curve: list[float], window: int = WINDOW) -> list[float]:
    """The running mean of ``curve`` over the last ``window`` steps (fewer at the start)."""
    return [statistics.fmean(curve[max(0, i - window + 1) : i + 1]) for i in range(len(curve))]


def delay(base: list[float], other: list[float], window: int = WINDOW) -> float:
    """How many steps later than ``base`` the curve ``other`` first reaches the loss ``base`` had
    ``window`` steps before its end, both smoothed over ``window`` steps (linear between steps;
    negative: ``other`` is ahead; ``inf``: it never gets there). A gap in the loss at a fixed step
    where the loss still falls steeply can be a delay of a few steps; on a flat, noisy curve near
    the loss floor the delay says little (the curve first dips to that loss long before)."""
    if len(base) <= window:
        raise ValueError(f"delay needs curves longer than the window ({window} steps); got {len(base)} steps")
    b, o = smooth(base, window), smooth(other, window)
    target = b[len(b) - 1 - window]

    def reach(curve: list[float]) -> float:
        for i, value in enumerate(curve):
            if value <= target:
                if i == 0 or curve[i - 1] <= target:
                    return float(i)
                return i - 1 + (curve[i - 1] - target) / (curve[i - 1] - value)
        return float("inf")

    return reach(o) - reach(b)


@dataclasses.dataclass
class Contender:
    """One model trained through its own Rig; ``run(n)`` takes n steps and returns the seconds."""

    name: str
    run: Callable[[int], float]
    losses: list[torch.Tensor]


def make_contender(
    name: str, precision: Any, cfg: Config, batches: torch.Tensor, device: torch.device, compile_: Any, fsdp: bool
) -> Contender:
    rig = torchrig.Rig(
        accelerator=device.type,
        devices=1,
        strategy=torchrig.FSDPStrategy(auto_wrap_policy={Block}) if fsdp else "single",
        precision=precision,
        compile=compile_,
    )
    torch.manual_seed(0)
    model = rig.prepare(Transformer(cfg))
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))
    data = batches.to(device)
    losses: list[torch.Tensor] = []

    def run(steps: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            tokens = data[len(losses)]
            with rig.autocast():
                loss = loss_of(model(tokens[:, :-1]), tokens[:, 1:])
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        sync(device)
        return time.perf_counter() - start

    return Contender(name, run, losses)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def take_turns(
    contenders: list[Contender],
    rounds: int,
    per_round: int,
    deadline: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, list[float]], int]:
    """Up to ``rounds`` rounds of ``per_round`` steps of every contender (the order rotating each
    round); no round begins that would end past ``deadline`` (on ``clock``) if it took as long as
    the last one. Returns each contender's seconds per round and the number of rounds taken."""
    seconds: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        last = sum(s[-1] for s in seconds.values()) if r else 0.0
        if clock() + last > deadline:
            return seconds, r
        for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
            seconds[c.name].append(c.run(per_round))
    return seconds, rounds


def part1(args: argparse.Namespace, cfg: Config, device: torch.device) -> None:
    total, warmup, per_round = args.total, args.warmup, args.steps
    rounds = (total - warmup) // per_round
    if rounds < 1 or warmup + rounds * per_round != total:
        raise SystemExit(f"--total {total} must be --warmup {warmup} + a whole number of rounds of --steps {per_round}")
    known = precisions()
    keys = args.contenders.split(",")
    if any(k not in known for k in keys) or len(set(keys)) != len(keys):
        raise SystemExit(f"--contenders {args.contenders!r}: a comma-separated choice of {', '.join(known)}")
    deadline = float("inf") if args.budget is None else time.perf_counter() + args.budget
    batches = structured_tokens(cfg, total * cfg.batch).view(total, cfg.batch, cfg.seq + 1)
    contenders: list[Contender] = []
    failed: dict[str, str] = {}
    for key in keys:
        name, precision = known[key]
        if args.smoke and key == "bf16":  # the CPU: bf16 autocast is slower than fp32 on most CPUs
            name = precision = "32-true"
        if time.perf_counter() >= deadline:
            failed[name] = f"skipped: the --budget of {args.budget:.0f} s was spent before its warm-up"
            print(f"{name}: {failed[name]}", flush=True)
            continue
        try:
            contender = make_contender(name, precision, cfg, batches, device, args.compile, not args.single)
            start = time.perf_counter()
            contender.run(warmup)
            print(f"{name}: {warmup} warm-up steps (compilation) in {time.perf_counter() - start:.1f} s", flush=True)
            contenders.append(contender)
        except Exception as err:  # one contender failing must not lose the others' numbers
            traceback.print_exc()
            failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    seconds, done = take_turns(contenders, rounds, per_round, deadline)
    if done < rounds:
        print(f"budget: --budget {args.budget:.0f} s reached: {done} of {rounds} rounds taken", flush=True)
    if contenders and done == 0:
        contenders, failed = [], {**failed, **{c.name: "no round within the --budget" for c in contenders}}
    tokens = cfg.batch * cfg.seq * per_round
    flops = flops_per_step(cfg)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = device_peak_flops(name)
    base = seconds.get(contenders[0].name) if contenders else None
    base_curve = torch.stack(contenders[0].losses).float().cpu().tolist() if contenders else []
    body = []
    for c in contenders:
        times = seconds[c.name]
        ratios = [b / t for b, t in zip(base or times, times, strict=True)]
        ratio = f"{statistics.median(ratios):.3f}x"
        interval = median_interval(ratios)
        if interval is not None and c is not contenders[0]:
            ratio += f" ({interval[0]:.3f}-{interval[1]:.3f})"
        curve = torch.stack(c.losses).float().cpu().tolist()
        mfu = "n/a" if peak is None else f"{statistics.median(flops * per_round / t for t in times) / peak:.1%}"
        columns = []
        for n in (WINDOW, 5 * WINDOW):
            mean = statistics.fmean(curve[-n:])
            columns.append(f"{mean:.4f} ({mean / statistics.fmean(base_curve[-n:]) - 1:+.2%})")
        body.append(
            [
                c.name,
                f"{statistics.median(tokens / t for t in times):,.0f}",
                ratio,
                mfu,
                f"{curve[0]:.3f}",
                *columns,
                f"{delay(base_curve, curve):+.1f}" if len(curve) > WINDOW else "n/a",
            ]
        )
    for name_, why in failed.items():
        body.append([name_, "failed", why[:80], "", "", "", "", ""])
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(cfg).parameters())
    steps = warmup + done * per_round
    title = (
        f"{'SMOKE (a check, not a measurement): ' if args.smoke else ''}{cfg.layers}-block Llama-style model, "
        f"{params / 1e6:,.1f}M parameters, seq {cfg.seq}, {cfg.batch} seq/step, 1 x {name}, "
        f"{'single' if args.single else 'fsdp'}, compile={args.compile}; {steps} steps each ({warmup} warm-up, then "
        f"{done} rounds of {per_round} taking turns); loss: mean of the last 10 and 50 steps (vs the first row); "
        "delay: steps behind the first row's smoothed loss curve at its end"
    )
    first = contenders[0].name if contenders else "-"
    print_table(
        title,
        ["precision", "tokens/s", f"vs {first}", "MFU", "first loss", "loss, last 10", "loss, last 50", "delay"],
        body,
        markdown=args.markdown,
    )
    print(environment_line(name) + f"; {flops / 1e9:,.3f} GFLOP per step (FlopCounterMode)")
    print("targets (issue 32, one GPU): fp8-mixed >= 1.2x bf16-mixed tokens/s; loss after 200 steps within 1%")
    print(f"command: python benchmarks/gpu_fp8.py {' '.join(sys.argv[1:])}")


def try_large(args: argparse.Namespace, cfg: Config, device: torch.device) -> dict[str, Any]:
    """Part 2's child: ``--large-steps`` steps of one configuration; its numbers as a dict."""
    rig = torchrig.Rig(
        accelerator=device.type,
        devices=1,
        strategy=torchrig.FSDPStrategy(auto_wrap_policy={Block}),
        precision="32-true" if args.smoke else "bf16-mixed",
        compile=args.large_compile,
        activation_checkpointing="full",
    )
    torch.manual_seed(0)
    with rig.init_module():
        model: nn.Module = Transformer(cfg)
    model = rig.prepare(model)
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True))
    steps = args.large_steps
    data = structured_tokens(cfg, (steps + 2) * cfg.batch).view(steps + 2, cfg.batch, cfg.seq + 1).to(device)
    times: list[float] = []
    losses = []
    for i in range(steps + 2):  # 2 warm-up steps (compilation, the optimizer's state)
        sync(device)
        start = time.perf_counter()
        with rig.autocast():
            loss = loss_of(model(data[i][:, :-1]), data[i][:, 1:])
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(cfg).parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = device_peak_flops(name)
    flops = flops_per_step(cfg)
    step = statistics.median(times)
    return {
        "params": params,
        "tokens_per_s": cfg.batch * cfg.seq / step,
        "step_s": step,
        "mfu": None if peak is None else flops / step / peak,
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "losses": [round(x, 4) for x in torch.stack(losses).float().cpu().tolist()],
        "device": name,
    }


def part2(args: argparse.Namespace) -> None:
    candidates = SMOKE_LARGE if args.smoke else LARGE
    rows, tried = [], []
    for label, cfg in candidates:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            label,
            "--large-steps",
            str(args.large_steps),
            "--large-compile",
            str(args.large_compile),
        ] + (["--smoke"] if args.smoke else [])
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, check=False)
            out, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as expired:
            out, err = "", f"TimeoutError: more than {args.child_timeout:.0f} s ({expired.stderr or ''!s:.200})"
        took = time.perf_counter() - start
        result = next((line[len("RESULT ") :] for line in out.splitlines() if line.startswith("RESULT ")), None)
        if result is None:
            tail = (err or out).strip().splitlines()
            why = next((line for line in reversed(tail) if "Error" in line), tail[-1] if tail else "no output")
            tried.append(f"{label} ({cfg.layers} blocks, width {cfg.dim}): does not train ({why[:160]}), {took:.0f} s")
            print(tried[-1], flush=True)
            continue
        r = json.loads(result)
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        memory = "n/a" if r["max_memory_gib"] is None else f"{r['max_memory_gib']:.1f}"
        rows.append(
            [
                label,
                f"{r['params'] / 1e9:.2f}B",
                f"{cfg.layers} x {cfg.dim} (hidden {cfg.hidden})",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['step_s']:.3f}",
                mfu,
                memory,
            ]
        )
        print(f"{label}: trains ({took:.0f} s in all); losses {r['losses']}", flush=True)
        break
    title = (
        f"{'SMOKE: ' if args.smoke else ''}largest model of the family on one device: FSDP2, "
        f"activation_checkpointing='full', compile={args.large_compile!r}, bf16-mixed, fused AdamW, "
        f"{(SMOKE if args.smoke else Config()).batch} x {(SMOKE if args.smoke else Config()).seq} tokens a step, "
        f"median of {args.large_steps} steps after 2"
    )
    print_table(
        title,
        ["model", "parameters", "blocks x width", "tokens/s", "s/step", "MFU", "peak memory (GiB)"],
        rows,
        markdown=args.markdown,
    )
    for line in tried:
        print("  tried first: " + line)
    print(f"command: python benchmarks/gpu_fp8.py {' '.join(sys.argv[1:])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check it runs")
    parser.add_argument("--largest", action="store_true", help="part 2: the largest model that trains")
    parser.add_argument("--single", action="store_true", help="part 1 without FSDP (strategy='single')")
    parser.add_argument("--total", type=int, default=None, help="steps per contender (default 200; smoke 6)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 8; smoke 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 12; smoke 2)")
    parser.add_argument("--no-compile", action="store_true", help="part 1 eager")
    parser.add_argument("--large-steps", type=int, default=None, help="part 2: timed steps (default 5; smoke 2)")
    parser.add_argument("--large-compile", default=None, help="part 2: compile= (default regional; smoke None)")
    parser.add_argument("--child-timeout", type=float, default=300, help="part 2: seconds per candidate")
    parser.add_argument(
        "--contenders", default="bf16,tensorwise,rowwise", help="part 1: which, in order (the first is the baseline)"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="part 1: seconds; no contender starts and no round begins past it"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    for field in ("dim", "layers", "heads", "hidden", "batch"):
        parser.add_argument(f"--{field}", type=int, default=None, help=f"part 1: the model's {field} (Config)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for the README)")
    args = parser.parse_args()
    smoke = args.smoke
    args.total = args.total or (6 if smoke else 200)
    args.warmup = args.warmup or (2 if smoke else 8)
    args.steps = args.steps or (2 if smoke else 12)
    args.large_steps = args.large_steps or (2 if smoke else 5)
    if args.large_compile in (None, "None"):
        args.large_compile = None if smoke else "regional"
    args.compile = None if (smoke or args.no_compile) else True
    device_type = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    if device_type == "cpu" and not smoke:
        parser.error("no GPU here: this benchmark is for GPUs (--smoke runs a tiny version on the CPU)")
    if smoke:
        torch.set_num_threads(1)
    if args.largest and args.child is None:
        part2(args)
        return
    _, _, local = init_group(device_type)
    device = torch.device(device_type, local) if device_type == "cuda" else torch.device("cpu")
    if args.child is not None:
        cfg = dict(SMOKE_LARGE if smoke else LARGE)[args.child]
        print("RESULT " + json.dumps(try_large(args, cfg, device)), flush=True)
    else:
        sizes = {f: getattr(args, f) for f in ("dim", "layers", "heads", "hidden", "batch") if getattr(args, f)}
        part1(args, dataclasses.replace(SMOKE if smoke else Config(), **sizes), device)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
