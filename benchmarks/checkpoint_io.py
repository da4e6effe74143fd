"""Checkpoint save/load time: ``rig.save``/``rig.load`` vs plain ``torch.save``/``torch.load``.

The same model + AdamW state (about ``--size-gb`` GB: weights plus two moments), in one run,
contenders interleaved round by round; the table reports the median of ``--repeats`` rounds.

* ``torch.save + fsync``: ``torch.save({"model": sd, "optimizer": osd}, f)``, then ``f.flush()``
  and ``os.fsync`` of the file and the directory (what a durable save costs): the baseline of
  the save target. ``torch.save, no fsync`` is shown for scale (no target).
* ``rig.save``: weights and optimizer moments in safetensors shards (~256 MB), the rest in
  ``state.pt``; SHA-256 of every file, fsync of every file and the directory, atomic rename.
  Target: at most 1.2x ``torch.save + fsync``.
* ``torch.load + load_state_dict``: ``torch.load(weights_only=True)`` then the model's and the
  optimizer's ``load_state_dict``: the baseline of the load target. ``rig.load (SHA-256
  verified)``: every checksum verified, then the same objects filled. Target: no slower.
  ``rig.load, verify=False`` shows what the checksums cost (no target).

The "wall vs torch" column is the median over rounds of each round's ratio (the two ran back
to back, in alternating order), with its range; the lines under the table state the targets.
Files go to ``--dir`` (default: a temp dir under /tmp), removed at the end. Reads come from the
page cache for both sides (the files were just written).

    python benchmarks/checkpoint_io.py --size-gb 1 --repeats 3

``--async``: how long the training loop is blocked per save. ``rig.save`` (synchronous: the
whole call) against ``rig.save(..., blocking=False)``, alternating round by round in one run.
The background save's call copies the weights to host memory; then one training iteration of
the whole model runs (forward and backward of a ``--batch`` of 64, AdamW step: every weight and
moment changes) while the background thread copies the optimizer moments, and the step waits
for that copy: "blocked" is the call plus that wait (timed by step pre-hooks around torchrig's).
How much slower that iteration is than one without a save is shown too, and the time of small
matmul steps run until the save is committed against the same steps with no save under way (the
writer shares the CPU). The first background save of a run also allocates the host copy the
later ones reuse: on its own line. Target: blocked at most 20% of the synchronous save.

    python benchmarks/checkpoint_io.py --async --size-gb 1 --repeats 5

``--url s3://BUCKET/PREFIX``: checkpoints on object storage. ``rig.save(url)`` (the files staged
locally with SHA-256, not fsynced, uploaded under a prefix of their own, ``meta.json`` last, then
the ``last`` object) against uploading the very same files with ``s3fs`` directly
(``fs.put``), and ``rig.load(url)`` (download, each object hashed as it arrives, every checksum
verified, objects filled) against downloading them with ``fs.get``; alternating round by
round. Target: at most 1.2x each. The client finds the server through the usual ``AWS_*``
variables (``AWS_ENDPOINT_URL`` for a local one); ``--start-moto`` starts a moto S3 server on
localhost in its own process and creates the bucket.

    python benchmarks/checkpoint_io.py --url s3://bench/ckpt --start-moto --size-gb 0.25 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

import torchrig

SAVE_BASE, SAVE_TARGET = "save: torch.save + fsync", "save: rig.save"
LOAD_BASE, LOAD_TARGET = "load: torch.load + load_state_dict", "load: rig.load (SHA-256 verified)"


def build(size_gb: float, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers holding ``size_gb / 3`` GB of fp32 weights, and AdamW with its moments made."""
    n_params = int(size_gb * 2**30 / 4 / 3)
    layers = max(1, n_params // (width * width))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_(0, 0.02)
        p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()  # creates exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (CPU time of all threads: robust on a shared machine)."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="model + optimizer state, in GB (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported (default 3)")
    parser.add_argument("--width", type=int, default=2048, help="width of the square Linear layers")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    parser.add_argument(
        "--async", dest="background", action="store_true", help="time the loop blocked per save, async vs sync"
    )
    parser.add_argument("--batch", type=int, default=64, help="--async: the batch of the training iteration")
    parser.add_argument("--url", default=None, help="s3://BUCKET/PREFIX: save and load on object storage vs s3fs")
    parser.add_argument("--start-moto", action="store_true", help="--url: start a moto S3 server on localhost")
    args = parser.parse_args(argv)
    if args.background:
        return async_main(args)
    if args.url:
        return url_main(args)

    torch.manual_seed(0)
    rig = torchrig.Rig(accelerator="cpu")
    model, optimizer = build(args.size_gb, args.width)
    state_bytes = sum(p.nbytes for p in model.parameters()) * 3
    root = Path(tempfile.mkdtemp(prefix="torchrig-ckpt-bench-", dir=args.dir))
    times: dict[str, list[tuple[float, float]]] = {}
    try:
        for r in range(args.repeats):
            for name, seconds in one_round(rig, model, optimizer, root, r):
                times.setdefault(name, []).append(seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(times, state_bytes, args, LOCAL)
    return 0


def one_round(
    rig: torchrig.Rig, model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, r: int
) -> list[tuple[str, tuple[float, float]]]:
    plain, plain_nosync, ours = root / f"plain-{r}.pt", root / f"nosync-{r}.pt", root / f"rig-{r}"
    out = []

    def torch_save_fsync() -> None:
        with open(plain, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(root)

    def torch_load() -> None:
        sd = torch.load(plain, weights_only=True)
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optimizer"])

    state = {"model": model, "optimizer": optimizer}
    # Alternate which side goes first, so neither always meets a cold or a warm cache.
    saves: list[tuple[str, Callable[[], object]]] = [
        (SAVE_BASE.split(": ")[1], torch_save_fsync),
        (SAVE_TARGET.split(": ")[1], lambda: rig.save(ours, state, link=None)),
    ]
    for name, fn in saves if r % 2 == 0 else saves[::-1]:
        out.append((f"save: {name}", timed(fn)))
    out.append(
        (
            "save: torch.save, no fsync (no target)",
            timed(lambda: torch.save(state_dicts(model, optimizer), plain_nosync)),
        )
    )
    loads: list[tuple[str, Callable[[], object]]] = [
        (LOAD_BASE.split(": ")[1], torch_load),
        (LOAD_TARGET.split(": ")[1], lambda: rig.load(ours, state)),
        ("rig.load, verify=False (no target)", lambda: torchrig.checkpoint.load(rig, ours, state, verify=False)),
    ]
    for name, fn in loads if r % 2 == 0 else loads[::-1]:
        out.append((f"load: {name}", timed(fn)))
    for p in (plain, plain_nosync):
        p.unlink()
    shutil.rmtree(ours)
    return out


# -- --async: the time the loop is blocked per save ---------------------------------------------
BLOCK_BASE, BLOCK_TARGET = "blocked: rig.save (synchronous)", "blocked: rig.save(blocking=False)"
BACKGROUND = "background: write, fsync, SHA-256, commit (no target)"
FIRST = "blocked: first blocking=False save, allocates the host copy (no target)"
ASYNC_LIMIT = 0.20


def _train_step(x: torch.Tensor) -> None:
    """A stand-in for a training step: four 512 x 512 matmuls (tens of milliseconds here)."""
    for _ in range(4):
        x = torch.tanh(x @ x)


def async_main(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    rig = torchrig.Rig(accelerator="cpu")
    model, optimizer = build(args.size_gb, args.width)
    state = {"model": model, "optimizer": optimizer}
    state_bytes = sum(p.nbytes for p in model.parameters()) * 3
    root = Path(tempfile.mkdtemp(prefix="torchrig-ckpt-bench-", dir=args.dir))
    x, batch = torch.randn(512, 512) / 23, torch.randn(args.batch, args.width)
    times: dict[str, list[float]] = {}
    steps: list[float] = []  # a training step during a background save / with none under way
    slowed: list[float] = []  # the iteration right after a background save / one without

    def iteration() -> None:
        """Forward, backward and AdamW step of the whole model: it changes every weight and moment."""
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    def synchronous(path: Path) -> float:
        return timed(lambda: rig.save(path, state, link=None))[0]

    def background(name: str) -> float:
        base = timed(iteration)[0]
        marks: dict[str, float] = {}

        def mark(name: str) -> Callable[..., None]:
            return lambda *_: marks.__setitem__(name, marks.get(name, time.perf_counter()))

        # Step pre-hooks run in the order they were added: these two surround torchrig's own, which
        # makes the next optimizer.step() wait for the copy of the moments.
        before = optimizer.register_step_pre_hook(mark("before"))
        start = time.perf_counter()
        handle = rig.save(root / name, state, link=None, blocking=False)
        blocked = time.perf_counter() - start
        after = optimizer.register_step_pre_hook(mark("after"))
        iteration()  # the moments are copied beside forward and backward
        slowed.append((time.perf_counter() - start - blocked) / base)
        before.remove()
        after.remove()
        blocked += marks["after"] - marks["before"]
        during = []
        while not handle.done():
            t = time.perf_counter()
            _train_step(x)
            during.append(time.perf_counter() - t)
        done = time.perf_counter() - start
        handle.wait()
        idle = []
        for _ in range(len(during)):
            t = time.perf_counter()
            _train_step(x)
            idle.append(time.perf_counter() - t)
        if during:
            steps.append(statistics.median(during) / statistics.median(idle))
        times.setdefault(BACKGROUND, []).append(done)
        return blocked

    try:
        times[FIRST] = [background("first")]
        shutil.rmtree(root / "first")
        for r in range(args.repeats):
            sync, later = root / f"sync-{r}", f"async-{r}"
            contenders: list[tuple[str, Callable[[], float]]] = [
                (BLOCK_BASE, functools.partial(synchronous, sync)),
                (BLOCK_TARGET, functools.partial(background, later)),
            ]
            for name, fn in contenders if r % 2 == 0 else contenders[::-1]:
                times.setdefault(name, []).append(fn())
            shutil.rmtree(root / f"sync-{r}")
            shutil.rmtree(root / f"async-{r}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    async_report(times, steps, slowed, state_bytes, args)
    return 0


def async_report(
    times: dict[str, list[float]], steps: list[float], slowed: list[float], state_bytes: int, args: argparse.Namespace
) -> None:
    from rich.console import Console
    from rich.table import Table

    base = times[BLOCK_BASE]
    gib = state_bytes / 2**30
    table = Table(title=f"time the loop is blocked per save, {gib:.2f} GiB model + AdamW state, {args.repeats} rounds")
    for col in ("", "wall s (median)", "vs synchronous save (range)"):
        table.add_column(col, justify="left" if not col else "right")
    for name in (BLOCK_BASE, BLOCK_TARGET, BACKGROUND, FIRST):
        v = times[name]
        ratios = [w / base[min(i, len(base) - 1)] for i, w in enumerate(v)]
        shown = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        table.add_row(name, f"{statistics.median(v):.3f}", shown)
    console = Console(width=120)
    console.print(table)
    ratio = statistics.median(w / b for w, b in zip(times[BLOCK_TARGET], base, strict=True))
    console.print(
        f"target: '{BLOCK_TARGET}' at most {ASYNC_LIMIT:.2f}x '{BLOCK_BASE}': median {ratio:.2f}x -> "
        f"{'met' if ratio <= ASYNC_LIMIT else 'NOT met'}",
        highlight=False,
    )
    console.print(
        f"the training iteration right after a background save: {statistics.median(slowed):.2f}x one without "
        f"(median, range {min(slowed):.2f}-{max(slowed):.2f}; the copy of the moments and the writer share the CPU)",
        highlight=False,
    )
    if steps:
        console.print(
            f"a training step while a background save runs: {statistics.median(steps):.2f}x one with none under "
            f"way (median over saves, range {min(steps):.2f}-{max(steps):.2f}; no target)",
            highlight=False,
        )
    rounds = {k: [round(w, 2) for w in v] for k, v in times.items()}
    console.print(f"wall seconds per round: {rounds}", highlight=False)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.1f}; "
        f"command: python {' '.join(sys.argv)}",
        highlight=False,
    )


# -- --url: object storage against s3fs directly ------------------------------------------------
URL_SAVE_BASE, URL_SAVE = "save: s3fs put of the same files", "save: rig.save(url)"
URL_LOAD_BASE, URL_LOAD = "load: s3fs get of the same files", "load: rig.load(url) (SHA-256 verified)"


def _moto(bucket: str) -> subprocess.Popen[bytes]:
    """A moto S3 server on a free localhost port, in its own process; the environment points at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        ["moto_server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import s3fs

    for _ in range(100):
        try:
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
            break
        except OSError:
            time.sleep(0.1)
    return server


def url_main(args: argparse.Namespace) -> int:
    import fsspec

    url = args.url.rstrip("/")
    server = _moto(url.split("://", 1)[1].split("/", 1)[0]) if args.start_moto else None
    try:
        torch.manual_seed(0)
        rig = torchrig.Rig(accelerator="cpu")
        model, optimizer = build(args.size_gb, args.width)
        state = {"model": model, "optimizer": optimizer}
        state_bytes = sum(p.nbytes for p in model.parameters()) * 3
        fs, base = fsspec.core.url_to_fs(url)
        local = Path(tempfile.mkdtemp(prefix="torchrig-ckpt-bench-", dir=args.dir))
        times: dict[str, list[tuple[float, float]]] = {}
        try:
            rig.save(local / "files", state, link=None)  # the bytes both sides move
            names = sorted(p.name for p in (local / "files").iterdir())
            for r in range(args.repeats):
                direct, back = f"{base}/direct-{r}", local / f"back-{r}"

                def put(direct: str = direct) -> None:
                    fs.put([str(local / "files" / n) for n in names], [f"{direct}/{n}" for n in names])

                def get(direct: str = direct, back: Path = back) -> None:
                    back.mkdir()
                    fs.get([f"{direct}/{n}" for n in names], [str(back / n) for n in names])

                saves: list[tuple[str, Callable[[], object]]] = [
                    (URL_SAVE_BASE, put),
                    (URL_SAVE, lambda r=r: rig.save(f"{url}/rig-{r}", state)),
                ]
                loads: list[tuple[str, Callable[[], object]]] = [
                    (URL_LOAD_BASE, get),
                    (URL_LOAD, lambda r=r: rig.load(f"{url}/rig-{r}", state)),
                ]
                for group in (saves, loads):
                    for name, fn in group if r % 2 == 0 else group[::-1]:
                        times.setdefault(name, []).append(timed(fn))
                fs.rm(direct, recursive=True)
                fs.rm(f"{base}/rig-{r}", recursive=True)
                shutil.rmtree(back)
        finally:
            shutil.rmtree(local, ignore_errors=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    report(times, state_bytes, args, REMOTE)
    return 0


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


class Baselines(NamedTuple):
    """What a run's rows are measured against: ``base[save|load]``, the ``targets`` (row, its
    baseline, the most it may take), and the baselines' name in the column headers."""

    base: dict[str, str]
    targets: tuple[tuple[str, str, float], ...]
    versus: str


LOCAL = Baselines(
    {"save": SAVE_BASE, "load": LOAD_BASE}, ((SAVE_TARGET, SAVE_BASE, 1.2), (LOAD_TARGET, LOAD_BASE, 1.0)), "torch"
)
REMOTE = Baselines(
    {"save": URL_SAVE_BASE, "load": URL_LOAD_BASE},
    ((URL_SAVE, URL_SAVE_BASE, 1.2), (URL_LOAD, URL_LOAD_BASE, 1.2)),
    "s3fs",
)


def report(
    times: dict[str, list[tuple[float, float]]], state_bytes: int, args: argparse.Namespace, against: Baselines
) -> None:
    """The table (each row against its baseline), the targets met or not, the rounds."""
    from rich.console import Console
    from rich.table import Table

    base, targets, versus = against
    where = f" at {args.url}" if args.url else ""
    gib = state_bytes / 2**30
    title = f"checkpoint I/O{where}, {gib:.2f} GiB model + AdamW state, median of {args.repeats} rounds"

    wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    # Each round's ratio pairs two contenders run back to back: steadier than a ratio of medians.
    ratio = {k: [w / times[base[k.split(":")[0]]][i][0] for i, (w, _) in enumerate(v)] for k, v in times.items()}
    table = Table(title=title)
    for col in ("operation", "wall s", "GiB/s", f"wall vs {versus} (range)", "CPU s", f"CPU vs {versus}"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for name in times:
        b = base[name.split(":")[0]]
        table.add_row(
            name,
            f"{wall[name]:.3f}",
            f"{gib / wall[name]:.2f}",
            f"{statistics.median(ratio[name]):.2f}x ({min(ratio[name]):.2f}-{max(ratio[name]):.2f})",
            f"{cpu[name]:.3f}",
            f"{cpu[name] / cpu[b]:.2f}x",
        )
    console = Console(width=120)
    console.print(table)
    for row, b, limit in targets:
        r = statistics.median(ratio[row])
        console.print(
            f"target: '{row}' at most {limit:.1f}x '{b}': median {r:.2f}x -> {'met' if r <= limit else 'NOT met'}",
            highlight=False,
        )
    rounds = {k: [round(w, 2) for w, _ in v] for k, v in times.items()}
    console.print(f"wall seconds per round: {rounds}", highlight=False)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.1f}; "
        f"command: python {' '.join(sys.argv)}",
        highlight=False,
    )


if __name__ == "__main__":
    sys.exit(main())
