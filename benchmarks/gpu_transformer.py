"""Tokens/s and MFU of a ~1B-parameter Llama-style model: a hand-written FSDP2 loop, the same
loop through ``Rig``, and the ``Trainer``, alternating in one run.

    python benchmarks/gpu_transformer.py                                   # one GPU, in-process
    torchrun --nproc-per-node 8 benchmarks/gpu_transformer.py              # every local GPU
    python benchmarks/gpu_transformer.py --smoke                           # tiny, on the CPU (< 1 min)

The model: 18 blocks, width 2048, 16 heads, RMSNorm, rotary positions, SwiGLU MLP (hidden 5632),
causal attention through ``F.scaled_dot_product_attention``, vocabulary 32,000, untied output
(1.06B parameters), sequence 2048, micro-batch ``--batch`` (4) sequences per GPU. Every contender
runs it the same way: bf16-mixed (FSDP2's ``MixedPrecisionPolicy`` computing in bf16 and reducing
in fp32, under bf16 autocast, as ``precision="bf16-mixed"`` does), the whole model compiled
(``compile=True``: ``module.compile()``), each block sharded on its own and then the root
(``fully_shard``), AdamW, batches from a ``DataLoader`` over the same token tensor. The three are
built once (three models and optimizers live at once: 12 bytes a parameter each between steps,
about 13 GB at 1B on one GPU, less per GPU when sharded; ``--batch`` sets the activations' share)
and warmed up (compilation), then take turns: the Trainer fits all the
rounds in one ``fit``, and a callback at the end of each of its rounds runs a round of the
hand-written loop and of the Rig loop (in alternating order). A round is ``--steps`` optimizer
steps between two ``torch.cuda.synchronize()``; tokens/s counts every GPU's tokens (global).
The table shows the median over rounds, the median of the per-round ratios of tokens/s to the
hand-written loop's (above 1.0: faster; a 95% interval from 6 rounds on), and MFU: FLOPs per step (counted once on a
``meta``-device copy with ``torchrig.trainer.throughput.measure_flops``) x steps / seconds / the
device's bf16 dense peak (``PEAK_TFLOPS``; none on other devices). The Trainer also runs a
``ThroughputMonitor`` (given the same FLOPs), whose own last MFU is printed under the table (its
windows leave the other contenders' rounds out: ``monitor.paused()``).

Targets (issue 18, on a GPU): Rig and Trainer >= 0.99x the hand-written tokens/s; MFU >= 40% on
one H100 SXM. Measured on one H200 and on one H100 (README.md has the H100 table).

``--smoke`` changes, to run on the CPU in under a minute (a check that all of it runs, not a
measurement): a 2-block, width-64 model (vocabulary 256, sequence 64, micro-batch 2), fp32
(``32-true``; bf16 autocast on most CPUs is slower than fp32), compilation off (inductor would
take minutes on a shared CPU), gloo instead of NCCL, 2 rounds of 2 steps after 1 warm-up step.
It still shards with FSDP2 (one process) unless ``--strategy single``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment_line, median_interval, print_table

import torchrig
from torchrig.trainer.throughput import ThroughputMonitor, device_peak_flops, measure_flops


@dataclass(frozen=True)
class Config:
    vocab: int = 32_000
    dim: int = 2048
    layers: int = 18
    heads: int = 16
    hidden: int = 5632
    seq: int = 2048
    batch: int = 4  # sequences per GPU per step


SMOKE = Config(vocab=256, dim=64, layers=2, heads=4, hidden=176, seq=64, batch=2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, ``(seq, head_dim / 2)`` each (base 10,000)."""
    half = cfg.dim // cfg.heads // 2
    inv = 1.0 / (10_000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on ``x`` (batch, heads, seq, head_dim), its halves as the pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(cfg: Config) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)


def flops_per_step(cfg: Config) -> int:
    """Forward+backward FLOPs of one micro-batch on one device, counted on a ``meta`` copy."""
    with torch.device("meta"):
        model = Transformer(cfg)
        tokens = torch.zeros(cfg.batch, cfg.seq + 1, dtype=torch.long)
    return measure_flops(lambda: loss_of(model(tokens[:, :-1]), tokens[:, 1:]).backward())


@dataclass
class Setup:
    cfg: Config
    device: torch.device
    world: int
    rank: int
    fsdp: bool
    compile: bool
    precision: str
    rig_loss_outside_autocast: bool
    steps: int  # per round
    rounds: int
    warmup: int

    def loader(self) -> DataLoader[torch.Tensor]:
        """Token sequences (``seq + 1`` each: inputs and shifted targets), one epoch enough for
        the warm-up and every round on every rank."""
        n = (self.warmup + self.rounds * self.steps + 1) * self.cfg.batch * self.world
        tokens = torch.randint(0, self.cfg.vocab, (n, self.cfg.seq + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(tokens, batch_size=self.cfg.batch)  # type: ignore[arg-type]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def endless(loader: DataLoader[torch.Tensor]) -> Iterator[torch.Tensor]:
    epoch = 0
    while True:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def hand_written(s: Setup) -> Callable[[int], float]:
    """Plain PyTorch: ``module.compile()``, ``fully_shard`` per block and the root, autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model: nn.Module = make_model(s.cfg)
    mixed = s.precision == "bf16-mixed"
    if s.compile:
        model.compile()
    if s.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed else None, reduce_dtype=torch.float32)
        # The run's device type: fully_shard's default mesh is the GPU's whenever one is present.
        mesh = init_device_mesh(s.device.type, (s.world,))
        model.to(s.device)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        model.to(s.device)
    optimizer = make_optimizer(model.parameters())
    loader = s.loader()
    if s.world > 1:
        loader = DataLoader(loader.dataset, batch_size=s.cfg.batch, sampler=DistributedSampler(loader.dataset))
    batches = endless(loader)
    autocast = torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=mixed)

    def run(steps: int) -> float:
        s.sync()
        start = time.perf_counter()
        for _ in range(steps):
            tokens = next(batches).to(s.device, non_blocking=True)
            with autocast:
                loss = loss_of(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        s.sync()
        return time.perf_counter() - start

    return run


def strategy_of(s: Setup) -> Any:
    return torchrig.FSDPStrategy(auto_wrap_policy={Block}) if s.fsdp else "single"


def rig_loop(s: Setup) -> Callable[[int], float]:
    """The same loop through ``Rig``: ``prepare`` (model, optimizer, loader), the loss under
    ``rig.autocast()`` as the hand-written loop takes it under autocast, and ``rig.backward``.
    With ``--rig-loss-outside-autocast`` the loss is taken outside it, where the prepared model
    returns float32 logits (a copy of the bf16 ones) so that the loss runs in float32."""
    rig = torchrig.Rig(
        accelerator=s.device.type, devices=s.world, strategy=strategy_of(s), precision=s.precision, compile=s.compile
    )
    model = rig.prepare(make_model(s.cfg))
    optimizer = rig.prepare(make_optimizer(model.parameters()))
    batches = endless(rig.prepare(s.loader()))
    autocast = contextlib.nullcontext() if s.rig_loss_outside_autocast else rig.autocast()

    def run(steps: int) -> float:
        s.sync()
        start = time.perf_counter()
        for _ in range(steps):
            tokens = next(batches)
            with autocast:
                loss = loss_of(model(tokens[:, :-1]), tokens[:, 1:])
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        s.sync()
        return time.perf_counter() - start

    return run


class LM(torchrig.TrainingModule):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.model = make_model(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_of(self(batch[:, :-1]), batch[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


class Rounds(torchrig.Callback):
    """Times the Trainer's rounds and, after each, runs a round of the other contenders."""

    def __init__(self, s: Setup, others: dict[str, Callable[[int], float]], monitor: ThroughputMonitor) -> None:
        self.s, self.others, self.monitor = s, others, monitor
        self.seconds: dict[str, list[float]] = {"Trainer": [], **{name: [] for name in others}}
        self.batches, self.start = 0, 0.0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        s = self.s
        self.batches += 1
        done = self.batches - s.warmup
        if done < 0 or done % s.steps:
            return
        s.sync()
        if done:
            self.seconds["Trainer"].append(time.perf_counter() - self.start)
            names = list(self.others)
            if (done // s.steps) % 2 == 0:
                names.reverse()
            with self.monitor.paused():  # the monitor times the Trainer's steps alone
                for name in names:
                    self.seconds[name].append(self.others[name](s.steps))
        self.start = time.perf_counter()


def run(s: Setup, flops: int, peak: float | None) -> tuple[dict[str, list[float]], ThroughputMonitor]:
    others = {"hand-written": hand_written(s), "Rig": rig_loop(s)}
    for warm in others.values():
        warm(s.warmup)
    monitor = ThroughputMonitor(flops_per_batch=flops, peak_flops=peak)
    rounds = Rounds(s, others, monitor)
    trainer = torchrig.Trainer(
        accelerator=s.device.type,
        devices=s.world,
        strategy=strategy_of(s),
        precision=s.precision,
        compile=s.compile,
        max_steps=s.warmup + s.rounds * s.steps,
        max_epochs=-1,
        log_every_n_steps=s.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[rounds, monitor],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ThroughputMonitor: no known peak")  # the CPU: said below
        trainer.fit(LM(s.cfg), s.loader())
    return rounds.seconds, monitor


def init_group(device_type: str) -> tuple[int, int, int]:
    """A process group (NCCL on GPUs, gloo on the CPU): torchrun's, or one of a single process."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check it runs (< 1 min)")
    parser.add_argument("--strategy", choices=["fsdp", "single"], default="fsdp", help="single: one device only")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (median), default 7 (smoke 2)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per round, default 10 (smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing, default 5 (smoke 1)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per GPU per step (default 4)")
    parser.add_argument("--no-compile", action="store_true", help="eager (compile=None) for every contender")
    parser.add_argument(
        "--rig-loss-outside-autocast",
        action="store_true",
        help="the Rig loop takes its loss outside rig.autocast() (on float32 copies of the logits)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    args = parser.parse_args()

    cfg = SMOKE if args.smoke else Config()
    if args.batch is not None:
        cfg = dataclasses.replace(cfg, batch=args.batch)
    device_type = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device_type == "cpu" and not args.smoke:
        parser.error("no GPU here: this benchmark is for GPUs (--smoke runs a tiny version on the CPU)")
    fsdp = args.strategy == "fsdp"
    if fsdp or "RANK" in os.environ:
        rank, world, local = init_group(device_type)
    else:
        rank, world, local = 0, 1, 0
    if not fsdp and world > 1:
        parser.error(f"--strategy single runs on one device; this run has {world} processes (use fsdp)")
    if args.smoke:
        torch.set_num_threads(1)
    s = Setup(
        cfg=cfg,
        device=torch.device(device_type, local) if device_type == "cuda" else torch.device("cpu"),
        world=world,
        rank=rank,
        fsdp=fsdp,
        compile=not (args.smoke or args.no_compile),
        precision="32-true" if args.smoke else "bf16-mixed",
        rig_loss_outside_autocast=args.rig_loss_outside_autocast,
        steps=args.steps or (2 if args.smoke else 10),
        rounds=args.rounds or (2 if args.smoke else 7),
        warmup=args.warmup or (1 if args.smoke else 5),
    )
    flops = flops_per_step(cfg)
    name = torch.cuda.get_device_name(s.device) if device_type == "cuda" else "cpu"
    peak = device_peak_flops(name)
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(cfg).parameters())
    seconds, monitor = run(s, flops, peak)
    if rank == 0:
        report(s, args, seconds, flops, peak, params, name, monitor)
    if dist.is_initialized():
        dist.destroy_process_group()


def report(
    s: Setup,
    args: argparse.Namespace,
    seconds: dict[str, list[float]],
    flops: int,
    peak: float | None,
    params: int,
    name: str,
    monitor: ThroughputMonitor,
) -> None:
    cfg = s.cfg
    tokens = cfg.batch * cfg.seq * s.steps * s.world  # per round, every GPU's
    base = seconds["hand-written"]
    body = []
    for contender in ("hand-written", "Rig", "Trainer"):
        times = seconds[contender]
        rate = statistics.median(tokens / t for t in times)
        ratios = [b / t for b, t in zip(base, times, strict=True)]  # tokens/s over the hand-written's
        ratio = f"{statistics.median(ratios):.3f}x"
        interval = median_interval(ratios)
        if interval is not None and contender != "hand-written":
            ratio += f" ({interval[0]:.3f}-{interval[1]:.3f})"
        mfu = "n/a" if peak is None else f"{statistics.median(flops * s.steps / t for t in times) / peak:.1%}"
        body.append([contender, f"{rate:,.0f}", ratio, mfu])
    title = (
        f"{'SMOKE (a check, not a measurement): ' if args.smoke else ''}"
        f"{cfg.layers}-block Llama-style model, {params / 1e6:,.1f}M parameters, seq {cfg.seq}, "
        f"{cfg.batch} seq/GPU, {s.world} x {name}, {'fsdp' if s.fsdp else 'single'}, {s.precision}, "
        f"compile={s.compile}; median of {s.rounds} rounds of {s.steps} steps"
        + ("; the Rig loop's loss outside rig.autocast()" if s.rig_loss_outside_autocast else "")
    )
    print_table(title, ["contender", "tokens/s", "vs hand-written", "MFU"], body, markdown=args.markdown)
    print(environment_line(name) + f"; {flops / 1e9:,.3f} GFLOP per micro-batch per device (FlopCounterMode)")
    logged = monitor.last_values.get("throughput/mfu")
    print(
        "ThroughputMonitor's last window in the Trainer: "
        + (f"MFU {logged:.1%}" if logged is not None else "no MFU (no known peak for this device)")
        + f", {monitor.last_values.get('throughput/tflops_per_device', math.nan):.3g} TFLOP/s per device"
    )
    print("targets (a GPU): Rig and Trainer >= 0.99x the hand-written tokens/s; MFU >= 40% on one H100 SXM")
    launcher = ["torchrun", f"--nproc-per-node {s.world}"] if s.world > 1 else ["python"]
    cmd = " ".join([*launcher, "benchmarks/gpu_transformer.py", *sys.argv[1:]])
    print(f"command: {cmd}")


if __name__ == "__main__":
    main()
