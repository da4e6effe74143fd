"""Exit cleanly after gloo collectives: let gloo's worker threads let go of the last collective
before the interpreter shuts down.

A gloo collective runs on one of the process group's worker threads. The caller's ``wait()``
returns as soon as the result is there, and the worker drops its reference to the finished work
a moment later. When that reference is the last one, the worker frees the work's tensors, and
freeing a tensor that Python has seen takes the GIL. If the main thread has reached the end of
the script and started shutting the interpreter down in that moment (a script whose last line is a
collective, on a loaded machine), taking the GIL ends the worker thread with ``pthread_exit``,
whose unwinding through a C++ destructor calls ``std::terminate``: the process aborts ("terminate
called without an active exception", exit code -6) after all its work succeeded. This is
pytorch/pytorch#190489, open in every release torchrig supports; ``destroy_process_group`` does not
help, since it neither stops gloo's worker threads nor waits for them.

:func:`settle_at_exit` registers :func:`wait_for_idle_workers` to run at exit, after the process
group is destroyed and while the interpreter is still whole: it returns once no gloo worker thread
of this process is running (each is asleep: waiting for work, or inside a collective waiting for
its peers), so none is left holding a finished collective. It reads the threads' states from
``/proc`` (Linux, where gloo runs on CPU clusters); elsewhere it returns at once.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

#: The name gloo's worker threads give themselves (c10d's ProcessGroupGloo::runLoop).
GLOO_WORKER = "pt_gloo_runloop"
#: Consecutive reads that must find every worker asleep (a worker between finishing a collective
#: and dropping it can sleep for an instant on the queue's lock).
QUIET_READS = 3

_registered: list[bool] = []


def settle_at_exit() -> None:
    """Have :func:`wait_for_idle_workers` run at exit (once per process). Call it before registering
    the handler that destroys the process group: ``atexit`` runs the later registration first."""
    if not _registered:
        _registered.append(True)
        atexit.register(wait_for_idle_workers)


def _worker_states(tasks: Path) -> list[str]:
    states = []
    for tid in os.listdir(tasks):
        try:
            if (tasks / tid / "comm").read_text().strip() != GLOO_WORKER:
                continue
            # /proc/<pid>/task/<tid>/stat: "tid (comm) state ..."; comm may hold spaces or ")".
            states.append((tasks / tid / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended while being read
            continue
    return states


def wait_for_idle_workers(timeout: float = 2.0, *, tasks: Path = Path("/proc/self/task")) -> bool:
    """Wait until no gloo worker thread of this process is running, for at most ``timeout``
    seconds. True when they all went quiet (or there are none, or no ``/proc`` to read)."""
    if not tasks.is_dir():
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < QUIET_READS:
        if all(state != "R" for state in _worker_states(tasks)):
            quiet += 1
        else:
            quiet = 0
            if time.monotonic() >= deadline:
                return False
        # Sleeping releases the GIL, which a worker freeing a collective's tensors may be waiting for.
        time.sleep(0.005)
    return True
