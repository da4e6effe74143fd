"""The crash-loop check of ``torchrig run --max-restarts`` on torch's own store (issue 28, item 7):
the job stops only after two attempts in a row that committed no checkpoint."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torchrig.strategies.parallel import CrashLoopError, _failure_key, _progress_key, check_progress


def _store(committed: dict[int, int]) -> dist.Store:
    store = dist.HashStore()
    for attempt, n in committed.items():
        store.add(_progress_key(attempt), n)
    return store


@pytest.mark.timeout(10)
def test_one_restart_without_progress_after_progress_goes_on() -> None:
    # attempt 0 committed 4 checkpoints and was killed; restart 1 failed before committing one
    store = _store({0: 4})
    store.set(_failure_key(1), "rank 1: RuntimeError: boom")
    check_progress(store, 2, 0)  # restart 2 runs: the attempt before restart 1 made progress
    store.add(_progress_key(2), 1)
    check_progress(store, 3, 0)


@pytest.mark.timeout(10)
def test_two_attempts_in_a_row_without_progress_stop_the_job() -> None:
    store = _store({0: 4})  # progress long ago does not keep a loop going
    store.set(_failure_key(2), "rank 1: RuntimeError: boom")
    with pytest.raises(
        CrashLoopError,
        match=r"rank 0: torchrig run --max-restarts: restart 2 committed no checkpoint before it failed, like the "
        r"attempt before it, .* Restart 2 failed with rank 1: RuntimeError: boom",
    ):
        check_progress(store, 3, 0)
    with pytest.raises(CrashLoopError, match=r"restart 1 committed no checkpoint before it failed"):
        check_progress(_store({}), 2, 0)
