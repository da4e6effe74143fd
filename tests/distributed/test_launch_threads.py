"""Every process torchrig starts gets at most ``cores // local processes`` intra-op threads,
unless the user set ``OMP_NUM_THREADS`` (issue 15, item 7)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from dist_helpers import SCRIPTS, env, explain

from conftest import printed_json
from torchrig.strategies import launch
from torchrig.strategies.launch import limit_threads, thread_env, worker_threads


@pytest.mark.parametrize(
    ("cores", "processes", "expected"), [(8, 2, 4), (8, 3, 2), (2, 2, 1), (2, 4, 1), (16, 1, None)]
)
def test_worker_threads_shares_the_cores_out(
    monkeypatch: pytest.MonkeyPatch, cores: int, processes: int, expected: int | None
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert worker_threads(processes) == expected
    assert thread_env(expected) == ({} if expected is None else {"OMP_NUM_THREADS": str(expected)})


def test_worker_threads_leaves_a_users_choice_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(2) is None
    assert thread_env(None) == {}


def _layouts(args: list[str], omp: str | None) -> dict[str, dict[str, Any]]:
    child_env = env()
    child_env.pop("OMP_NUM_THREADS", None)
    if omp is not None:
        child_env["OMP_NUM_THREADS"] = omp
    proc = subprocess.run(args, env=child_env, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, explain(proc)
    lines = printed_json(proc.stdout)
    return {line["layout"]: line for line in lines}


def _expected(parent_default: int) -> int:
    """What 2 processes on this machine get: the shared-out count, never more than torch's default."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)
        share = worker_threads(2)
    assert share is not None
    return min(share, parent_default)


@pytest.mark.distributed
@pytest.mark.timeout(100)
def test_spawned_and_forked_workers_share_the_cores() -> None:
    seen = _layouts([sys.executable, str(SCRIPTS / "threads.py"), "launch"], omp=None)
    n = _expected(seen["parent"]["threads"][0])
    assert seen["ddp_spawn"]["threads"] == [n, n]
    assert seen["ddp_notebook"]["threads"] == [n, n]


@pytest.mark.distributed
@pytest.mark.timeout(100)
def test_one_spawned_worker_runs_the_threads_its_script_chose() -> None:
    # torchrig demo --strategy ddp_spawn sets one thread, then spawns one worker (issue 30, item 9)
    seen = _layouts([sys.executable, str(SCRIPTS / "threads.py"), "one"], omp=None)
    assert seen["parent"]["threads"][0] > 1, "needs 2 cores to tell one thread from the default"
    assert seen["ddp_spawn"]["threads"] == [1]


@pytest.mark.distributed
@pytest.mark.timeout(100)
def test_processes_started_by_ddp_and_torchrig_run_share_the_cores() -> None:
    script = str(SCRIPTS / "threads.py")
    seen = _layouts([sys.executable, script, "ddp"], omp=None)
    n = _expected(seen["parent"]["threads"][0])
    assert seen["ddp"]["threads"] == [n, n]
    cli = [sys.executable, "-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", script, "ddp"]
    seen = _layouts(cli, omp=None)
    assert seen["ddp"]["threads"] == [n, n] and seen["ddp"]["env"] == str(n)


@pytest.mark.distributed
@pytest.mark.timeout(100)
def test_a_users_omp_num_threads_is_kept() -> None:
    # 2 threads: more than the 1 each of 2 processes gets on a 2-core machine, and torch caps the
    # variable at the cores, so the user's count is what the parent (the script) itself runs with.
    seen = _layouts([sys.executable, str(SCRIPTS / "threads.py"), "launch"], omp="2")
    user = seen["parent"]["threads"]
    assert seen["ddp_spawn"]["threads"] == user * 2 and seen["ddp_spawn"]["env"] == "2"
    assert seen["ddp_notebook"]["threads"] == user * 2
    seen = _layouts([sys.executable, str(SCRIPTS / "threads.py"), "ddp"], omp="2")
    assert seen["ddp"]["threads"] == user * 2 and seen["ddp"]["env"] == "2"


def test_a_running_process_is_only_ever_lowered() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        limit_threads(2)  # a lower count someone set is kept
        assert torch.get_num_threads() == 1
        limit_threads(None)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        limit_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
