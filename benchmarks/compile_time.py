"""Time to the first step and steady step time of a 12-block transformer through ``Rig``:
eager vs ``compile=True`` vs ``compile="regional"``, on the CPU (or ``--device cuda``), in one run.

    python benchmarks/compile_time.py [--blocks 12 32] [--dim 128] [--steps 30] [--floor] [--markdown]
    python benchmarks/compile_time.py --device cuda --compile-threads default   # on a GPU machine

Each contender runs in a fresh process with an empty inductor cache (a cold start, as a first
run of a job), on one thread, compiling in that thread (``TORCHINDUCTOR_COMPILE_THREADS=1``;
``--compile-threads default`` leaves inductor its own worker per core).
The first step (forward, backward, optimizer step) includes the compilation; it is timed in wall
seconds and in CPU seconds of the process and of the C++ compiler runs it waited for (the CPU
time leaves out what other programs on a shared machine took). The steady step time is the
median CPU time of ``--steps`` steps after 3 more (their wall time on an accelerator).
Targets (issue 18): regional's first step at most a third of whole-model compile's, and its
steady step no slower than whole-model compile's. ``--floor`` adds ``compile=True`` of a 1-block
model (the same embedding and head): about the cost of any first compile (inductor's start and
the C++ compiler runs for one block's kernels), which compiling one block's graph cannot go far
below. ``--blocks 12 32`` measures several depths. ``--warm-start`` has each process first
compile a tiny unrelated function (inductor's one-time start, paid by any first compilation in a
process), so that the first step shows what compiling this model adds, the part that
``compile=`` chooses. ``--paired-steady ROUNDS`` also builds the whole-model and the regional
contender in one process (after their warm-up) and lets them take turns, ``--steps`` steps a
round, the first to go alternating: the median ratio of their steady step times with a 95%
interval, free of the drift between separate processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import median_interval, print_table

CONTENDERS = {"eager": None, "compile=True": True, 'compile="regional"': "regional"}


def _cpu_with_children() -> float:
    """CPU seconds of this process and of its finished children (the C++ compiler inductor runs)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _start_inductor(device: str) -> None:
    """Compile and run (forward and backward) a tiny function unrelated to the model: what any
    first compilation in a process pays once (importing dynamo and inductor, the compiler
    toolchain's checks, inductor's compile workers, on a GPU Triton), whatever is compiled."""
    import torch

    x = torch.randn(8, device=device, requires_grad=True)
    torch.compile(lambda t: torch.nn.functional.gelu(t).sum())(x).backward()


def _stepper(name: str, blocks: int, dim: int, device: str) -> tuple[Callable[[], float], int]:
    """A training step of contender ``name`` (forward, backward, AdamW step; returns the loss)
    through ``Rig``, and the model's parameter count."""
    import torch
    from torch import nn

    import torchrig

    if device == "cpu":
        torch.set_num_threads(1)
    heads, seq, batch, vocab = 4, 64, 8, 512

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.norm2(x))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    rig = torchrig.Rig(accelerator=device, compile=CONTENDERS[name])
    model = rig.prepare(Transformer())
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, vocab, (batch, seq + 1)).to(rig.device)

    def step() -> float:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return step, sum(p.numel() for p in model.parameters())


def _clock(device: str) -> Callable[[], float]:
    """A step's clock: CPU seconds on the CPU (what other programs take is left out), wall seconds
    on an accelerator (each step ends in float(loss), which waits for the device)."""
    return time.process_time if device == "cpu" else time.perf_counter


def one(name: str, blocks: int, dim: int, steps: int, device: str = "cpu", warm_start: bool = False) -> dict[str, Any]:
    """Run one contender here; its timings (seconds)."""
    step, params = _stepper(name, blocks, dim, device)
    clock = _clock(device)
    if warm_start:
        _start_inductor(device)
    wall, cpu = time.perf_counter(), _cpu_with_children()
    loss = step()
    first_wall, first_cpu = time.perf_counter() - wall, _cpu_with_children() - cpu
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = clock()
        step()
        times.append(clock() - start)
    return {
        "first_wall": first_wall,
        "first_cpu": first_cpu,
        "step": statistics.median(times),
        "loss": loss,
        "params": params,
    }


def paired_steady(blocks: int, dim: int, rounds: int, steps: int, device: str) -> dict[str, Any]:
    """Steady step time of regional against whole-model compilation in one process: both are
    built and warmed up, then take turns, ``rounds`` rounds of ``steps`` steps each (which goes
    first alternates); the per-round ratios regional / whole, their median and 95% interval."""
    names = ("compile=True", 'compile="regional"')
    steppers = {name: _stepper(name, blocks, dim, device)[0] for name in names}
    for step in steppers.values():
        for _ in range(4):
            step()
    clock, ratios = _clock(device), []
    for i in range(rounds):
        seconds = {}
        for name in names if i % 2 == 0 else names[::-1]:
            start = clock()
            for _ in range(steps):
                steppers[name]()
            seconds[name] = clock() - start
        ratios.append(seconds[names[1]] / seconds[names[0]])
    return {"median": statistics.median(ratios), "interval": median_interval(ratios), "rounds": rounds}


def _in_child(args: list[str], compile_threads: str, what: str) -> dict[str, Any]:
    """This script run with ``args`` in a fresh process with its own empty inductor cache; the JSON
    it prints last. ``compile_threads``: ``TORCHINDUCTOR_COMPILE_THREADS``, or ``"default"`` for
    inductor's own choice (one compile worker per core, at most 32)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": compile_threads}
        if compile_threads == "default":
            del env["TORCHINDUCTOR_COMPILE_THREADS"]
        out = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{what} failed with exit code {out.returncode}:\n{out.stderr[-3000:]}")
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run(
    name: str,
    blocks: int,
    dim: int,
    steps: int,
    compile_threads: str = "1",
    device: str = "cpu",
    warm_start: bool = False,
) -> dict[str, Any]:
    """One contender (:func:`one`) in a fresh process."""
    args = ["--one", name, "--blocks", str(blocks), "--dim", str(dim), "--device", device, "--steps", str(steps)]
    return _in_child(args + (["--warm-start"] if warm_start else []), compile_threads, f"{name} ({blocks} blocks)")


def run_paired_steady(
    blocks: int, dim: int, rounds: int, steps: int, compile_threads: str, device: str
) -> dict[str, Any]:
    """:func:`paired_steady` in a fresh process."""
    args = ["--paired", "--paired-steady", str(rounds), "--blocks", str(blocks), "--dim", str(dim)]
    return _in_child([*args, "--steps", str(steps), "--device", device], compile_threads, "the paired steady run")


def table_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    return [
        [name, f"{r['first_wall']:.1f}", f"{r['first_cpu']:.1f}", f"{r['step'] * 1e3:.1f}", f"{r['loss']:.5f}"]
        for name, r in results.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[12], help="depths to measure (default 12)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--floor", action="store_true", help="also compile=True of a 1-block model: the fixed cost of a first compile"
    )
    parser.add_argument(
        "--compile-threads",
        default="1",
        help="inductor's compile threads: a number (default 1: compiling in the process's one thread) or "
        "'default' (inductor's own choice: a worker per core)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="the accelerator to run on (default cpu; 'cuda' on a GPU machine: Triton kernels instead of C++)",
    )
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="each process first compiles a tiny unrelated function (inductor's one-time start), "
        "so that the first step times only what compiling this model adds",
    )
    parser.add_argument(
        "--paired-steady",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time the steady step of regional against whole-model compilation in one process, "
        "taking turns for ROUNDS rounds of --steps steps (a ratio with a 95%% interval)",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--paired", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paired:
        print(json.dumps(paired_steady(args.blocks[0], args.dim, args.paired_steady, args.steps, args.device)))
        return
    if args.one:
        print(json.dumps(one(args.one, args.blocks[0], args.dim, args.steps, args.device, args.warm_start)))
        return
    import torch

    where = "CPU, 1 thread"
    if args.device != "cpu":
        module = getattr(torch, args.device)
        where = module.get_device_name() if hasattr(module, "get_device_name") else args.device
    for blocks in args.blocks:
        threads = args.compile_threads
        options = (threads, args.device, args.warm_start)
        results = {name: run(name, blocks, args.dim, args.steps, *options) for name in CONTENDERS}
        if args.floor:
            results["compile=True, 1 block"] = run("compile=True", 1, args.dim, args.steps, *options)
        params = results["eager"]["params"]
        title = (
            f"{blocks}-block transformer (dim {args.dim}, {params / 1e6:.1f}M parameters), {where}, "
            f"torch {torch.__version__}, cold inductor cache, compile threads: {args.compile_threads}"
            + ("; inductor started before the first step (--warm-start)" if args.warm_start else "")
        )
        steady = "steady step CPU (ms)" if args.device == "cpu" else "steady step wall (ms)"
        head = ["contender", "first step wall (s)", "first step CPU (s)", steady, "first loss"]
        print()
        print_table(title, head, table_rows(results), markdown=args.markdown)
        whole, regional = results["compile=True"], results['compile="regional"']
        print(
            f"regional / whole: first step {regional['first_wall'] / whole['first_wall']:.2f}x wall, "
            f"{regional['first_cpu'] / whole['first_cpu']:.2f}x CPU (target <= 0.33x); "
            f"steady step {regional['step'] / whole['step']:.2f}x (target <= 1.00x)"
        )
        if args.paired_steady:
            paired = run_paired_steady(blocks, args.dim, args.paired_steady, args.steps, threads, args.device)
            low, high = paired["interval"] or (math.nan, math.nan)
            print(
                f"steady step regional / whole, both in one process taking turns ({paired['rounds']} rounds of "
                f"{args.steps} steps): {paired['median']:.3f}x (95% interval {low:.3f}-{high:.3f})"
            )


if __name__ == "__main__":
    main()
