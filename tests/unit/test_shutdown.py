"""torchrig.strategies.shutdown: at exit, wait until gloo's worker threads have let go of the last
collective (pytorch/pytorch#190489: a worker freeing it during interpreter shutdown aborts the
process)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchrig.strategies import shutdown
from torchrig.strategies.shutdown import GLOO_WORKER, wait_for_idle_workers

needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread states from /proc")


class Worker:
    """A thread that calls itself gloo's worker (its native name, as /proc shows it) and busy-runs
    while ``busy`` is set, else sleeps."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self.stop = threading.Event()
        self.named = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(GLOO_WORKER)
        self.named.set()
        while not self.stop.is_set():
            if self.busy.is_set():  # running, without the GIL (as gloo's threads run): state R
                hashlib.sha256(bytes(1 << 22))
            else:
                self.stop.wait(0.01)  # asleep: state S


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    w.thread.start()
    assert w.named.wait(5)
    yield w
    w.stop.set()
    w.thread.join(5)


@needs_proc
def test_returns_at_once_when_the_workers_sleep(worker: Worker) -> None:
    start = time.monotonic()
    assert wait_for_idle_workers(timeout=5.0)
    assert time.monotonic() - start < 1.0


@needs_proc
def test_waits_while_a_worker_runs_and_gives_up_at_the_timeout(worker: Worker) -> None:
    worker.busy.set()
    start = time.monotonic()
    assert not wait_for_idle_workers(timeout=0.3)
    assert time.monotonic() - start >= 0.3


@needs_proc
def test_returns_once_a_running_worker_goes_to_sleep(worker: Worker) -> None:
    worker.busy.set()
    threading.Timer(0.4, worker.busy.clear).start()
    start = time.monotonic()
    assert wait_for_idle_workers(timeout=10.0)
    assert 0.4 <= time.monotonic() - start < 5.0


def fake_thread(tasks: Path, tid: int, comm: str, state: str) -> None:
    (tasks / str(tid)).mkdir(parents=True)
    (tasks / str(tid) / "comm").write_text(comm + "\n")
    (tasks / str(tid) / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4\n")


def test_only_gloo_workers_count_and_names_with_parentheses_parse(tmp_path: Path) -> None:
    fake_thread(tmp_path, 1, "python", "R")  # the caller itself runs: not a worker
    fake_thread(tmp_path, 2, "odd) R (name", "S")
    fake_thread(tmp_path, 3, GLOO_WORKER, "S")
    assert wait_for_idle_workers(timeout=0.0, tasks=tmp_path)
    fake_thread(tmp_path, 4, GLOO_WORKER, "R")
    assert not wait_for_idle_workers(timeout=0.05, tasks=tmp_path)


def test_without_proc_it_returns_at_once(tmp_path: Path) -> None:
    assert wait_for_idle_workers(timeout=5.0, tasks=tmp_path / "absent")


def test_registered_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(shutdown, "_registered", [])
    monkeypatch.setattr(shutdown.atexit, "register", calls.append)
    shutdown.settle_at_exit()
    shutdown.settle_at_exit()
    assert calls == [wait_for_idle_workers]


EXIT_SCRIPT = """
import os, torch, torchrig
import torch.distributed as dist
from torchrig.strategies import shutdown

real = shutdown.wait_for_idle_workers
def traced(*args, **kwargs):
    destroyed = not dist.is_initialized()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    ok = real(*args, **kwargs)
    workers = names.count(shutdown.GLOO_WORKER)
    print(f"rank {rank}: settled={ok} group_destroyed={destroyed} gloo_workers={workers}", flush=True)
    return ok
shutdown.wait_for_idle_workers = traced  # before the Rig registers it

rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
rank = rig.global_rank
model = rig.prepare(torch.nn.Linear(2, 2))  # DDP holds the process group: its threads outlive destroy
print(rig.all_gather(torch.tensor([rank])).tolist(), flush=True)
"""


@needs_proc
@pytest.mark.distributed  # two real ranks (gloo): 6.5 s of CPU in them, 13 s of wall on an idle 2-core machine
def test_a_ddp_process_waits_for_its_gloo_workers_at_exit(tmp_path: Path) -> None:
    """Two real ranks: the wait is registered by the strategy and runs after the process group
    is destroyed (the order atexit keeps), and finds gloo's real worker threads (still there: the
    DDP module holds the group) asleep."""
    import subprocess
    import sys

    from conftest import python_env

    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], env=python_env(), capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The two ranks print to one pipe at the same moment, unbuffered (PYTHONUNBUFFERED: a line's
    # text and its end are two writes), so one rank's line may end after the other's: find, not split.
    lines = sorted(re.findall(r"rank \d: settled=\w+ group_destroyed=\w+ gloo_workers=\d+", done.stdout))
    assert lines == [
        "rank 0: settled=True group_destroyed=True gloo_workers=2",
        "rank 1: settled=True group_destroyed=True gloo_workers=2",
    ], done.stdout
