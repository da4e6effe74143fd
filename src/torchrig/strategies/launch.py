"""Starting the processes of a run, and stopping all of them when one fails.

Two launchers, both on the standard library and ``torch.multiprocessing``:

* :class:`SubprocessLauncher` (``strategy="ddp"`` run as ``python script.py``): this process
  becomes local rank 0 and re-runs the same command line for ranks 1..N-1 with the
  ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables torchrun would set. It watches its children:
  when one exits with an error the others are stopped and this process exits non-zero.
* :func:`spawn` (``ddp_spawn``, ``ddp_notebook``): ``torch.multiprocessing.start_processes``
  with ``spawn`` or ``fork``; it already stops every worker when one raises and re-raises the
  error, naming the process, in the parent. Each worker gets its own copy of every tensor it is
  given (see :func:`spawn`).

Every process either launcher (or ``torchrig run``) starts gets at most :func:`worker_threads`
intra-op CPU threads, so N processes do not fight over the same cores.

Under torchrun or SLURM neither is used: the launcher already started (and watches) every rank.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from torchrig.clusters import ClusterEnvironment
from torchrig.devices import device_module
from torchrig.preemption import Preempted, stopped_for_signal

#: Set in processes started by :class:`SubprocessLauncher`: the pid of the rank-0 process.
PARENT_PID_VAR = "TORCHRIG_PARENT_PID"


def script_command() -> list[str]:
    """The command line that started this process, to start the other ranks with."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m package.module
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name, *sys.argv[1:]]
    main_file = getattr(__main__, "__file__", None)
    if not main_file or not sys.argv or not os.path.isfile(main_file):  # "<stdin>" for python -
        raise ValueError(
            "strategy='ddp' starts the other processes by running this script again, but this process "
            "was not started from a script file (an interactive session, a notebook, python -c, or a script "
            "read from stdin, python -). "
            "Use strategy='ddp_notebook' (fork) or 'ddp_spawn' with rig.launch(fn), or start the "
            "script with `torchrig run --devices N script.py`"
        )
    return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]


def launch_first(strategy: Any, call: str) -> str:
    """What ``call`` says when it runs before ``rig.launch(fn)`` started the processes of a
    ``spawn``/``fork`` strategy (``ddp_spawn``, ``ddp_notebook``)."""
    return (
        f"{call} needs the processes that {strategy!r} (ddp_spawn, ddp_notebook) starts in rig.launch(fn): put "
        "the training in a function fn(rig, ...) and call rig.launch(fn), which runs it in every process; or use "
        "strategy='ddp', which runs the whole script in every process"
    )


def worker_threads(local_processes: int) -> int | None:
    """Intra-op CPU threads for each of ``local_processes`` processes torchrig starts on this machine.

    The cores this process may run on, shared out: ``cores // local_processes``, at least 1 (what
    torchrun's one thread is for: N processes with every core each oversubscribe the machine).
    ``None`` (leave the count alone) when the user chose with ``OMP_NUM_THREADS`` or there is one
    process.
    """
    if os.environ.get("OMP_NUM_THREADS") or local_processes <= 1:
        return None
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroup cpusets)
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // local_processes)


def spawned_threads(local_processes: int) -> int:
    """Intra-op CPU threads for each of ``local_processes`` workers this process spawns or forks.

    What this process runs with (a ``torch.set_num_threads`` it made, which a new process would
    not inherit) and never more than :func:`worker_threads` shares out: one spawned worker of a
    script that chose one thread runs on one thread too.
    """
    import torch

    own = torch.get_num_threads()
    share = worker_threads(local_processes)
    return own if share is None else min(own, share)


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment a new process needs to start with ``threads`` intra-op threads."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def limit_threads(threads: int | None) -> None:
    """In a process already running: at most ``threads`` intra-op threads (a lower count is kept)."""
    import torch

    if threads is not None and torch.get_num_threads() > threads:
        torch.set_num_threads(threads)


def rank_env(
    *, global_rank: int, local_rank: int, node_rank: int, world_size: int, local_world_size: int, addr: str, port: int
) -> dict[str, str]:
    """The variables torchrun sets for one worker."""
    return {
        "RANK": str(global_rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _rendezvous(num_nodes: int) -> tuple[str, int, int]:
    """``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK`` from the environment, or this host and a free port."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    port_s = os.environ.get("MASTER_PORT")
    if port_s is None and num_nodes > 1:
        raise ValueError(
            f"num_nodes={num_nodes} without a launcher needs MASTER_ADDR, MASTER_PORT and NODE_RANK set on every "
            "machine (the same address and port everywhere); or start each machine with "
            "`torchrig run --num-nodes N --node-rank R --master-addr HOST --master-port PORT script.py`"
        )
    return addr, int(port_s) if port_s else find_free_port(addr), node_rank


class SubprocessLauncher:
    """Re-runs this script for local ranks 1..N-1 and watches them; this process is local rank 0.

    Args:
        num_processes: processes on this machine.
        num_nodes: machines in the run.
        timeout: the process-group timeout; also how long to wait at exit for the other ranks.
    """

    def __init__(self, *, num_processes: int, num_nodes: int, timeout: timedelta) -> None:
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.timeout = timeout
        self.join_timeout = timeout.total_seconds()
        #: The rendezvous store this process hosts (single machine), for ``init_process_group``.
        self.store: dist.TCPStore | None = None
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self._done = threading.Event()
        self._exit_codes: dict[int, int | None] = {}

    def start(self) -> ClusterEnvironment:
        """Start the other local ranks; returns this process's place in the run."""
        # Only other local ranks need this script run again (one process per machine starts none).
        cmd = script_command() if self.num_processes > 1 else []
        addr, port, node_rank = self._rendezvous()
        n, world = self.num_processes, self.num_processes * self.num_nodes

        def place(local_rank: int) -> dict[str, str]:
            return rank_env(
                global_rank=node_rank * n + local_rank,
                local_rank=local_rank,
                node_rank=node_rank,
                world_size=world,
                local_world_size=n,
                addr=addr,
                port=port,
            )

        threads = worker_threads(n)
        for local_rank in range(1, n):
            env = {**os.environ, **place(local_rank), **thread_env(threads), PARENT_PID_VAR: str(os.getpid())}
            self.children[node_rank * n + local_rank] = subprocess.Popen(cmd, env=env)
        os.environ.update(place(0))  # so code that reads RANK/WORLD_SIZE sees what the children see
        limit_threads(threads)
        threading.Thread(target=self._watch, name="torchrig-watch-ranks", daemon=True).start()
        atexit.register(self.join)
        return ClusterEnvironment(
            kind="torchrig",
            global_rank=node_rank * n,
            node_rank=node_rank,
            world_size=world,
            local_world_size=n,
            master_addr=addr,
            master_port=port,
            reason=f"torchrig started local ranks 1..{n - 1} itself",
        )

    def _rendezvous(self) -> tuple[str, int, int]:
        if self.num_nodes > 1 or "MASTER_PORT" in os.environ:
            return _rendezvous(self.num_nodes)
        # One machine: open the store on a port the OS picks *before* starting the children, so
        # no other program can take the port in between (the race of probing for a free port).
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.store = dist.TCPStore(
            addr, 0, world_size=self.num_processes, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        return addr, self.store.port, 0

    def _watch(self) -> None:
        # A failed rank leaves the others blocked in a collective until the timeout; stop them now.
        while not self._done.is_set():
            for rank, proc in list(self.children.items()):
                code = proc.poll()
                # A rank that stopped for a signal has saved with the others, who stop on their own.
                if code is not None and code != 0 and not stopped_for_signal(code):
                    _stderr(f"torchrig: rank {rank} exited with code {code}; stopping the other ranks\n")
                    self.kill()
                    os._exit(1)
            time.sleep(0.1)

    def kill(self, grace: float = 0.0) -> None:
        """Stop every child still running (after ``grace`` seconds; SIGTERM, then SIGKILL after 3 s)."""
        self._done.set()
        deadline = time.monotonic() + grace
        while grace and time.monotonic() < deadline and any(p.poll() is None for p in self.children.values()):
            time.sleep(0.05)
        # Remember how children ended on their own, so the report names the rank that failed first.
        self._exit_codes = {r: p.poll() for r, p in self.children.items()}
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3
        for proc in self.children.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def join(self) -> None:
        """Wait for the children at exit; exit non-zero when one of them failed."""
        deadline = time.monotonic() + self.join_timeout
        failed = []
        for rank, proc in self.children.items():
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            code = self._exit_codes.get(rank, code)
            if code != 0 and not stopped_for_signal(code):
                failed.append((rank, code))
        self._done.set()
        if failed:
            self.kill()
            what = ", ".join(f"rank {r} ({'still running' if c is None else f'exit code {c}'})" for r, c in failed)
            _stderr(f"torchrig: {what} did not finish cleanly\n")
            os._exit(1)


def watch_parent() -> None:
    """In a rank started by :class:`SubprocessLauncher`: exit if rank 0 disappears."""
    parent = os.environ.get(PARENT_PID_VAR)
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.5)
        _stderr(f"torchrig: rank 0 (pid {parent}) is gone; rank {os.environ.get('RANK')} stops too\n")
        os._exit(1)

    threading.Thread(target=watch, name="torchrig-watch-parent", daemon=True).start()


def _stderr(text: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:
        pass


#: What a ``spawn``/``fork`` worker calls: ``(fn, args, kwargs)``.
_Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

_previous_hook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] | None = None


def install_failure_report(
    rank: int,
    world_size: int,
    on_failure: Callable[[], None] | None = None,
    record: Callable[[str], None] | None = None,
) -> None:
    """Make an uncaught exception name the failing rank, stop local children, and tell torchrun.

    Under torchrun the error is also written to ``TORCHELASTIC_ERROR_FILE`` so torchrun's summary
    shows this rank's error instead of "To enable traceback see...".
    """
    global _previous_hook
    if _previous_hook is None:  # a second Rig in the same process replaces, not stacks, the hook
        _previous_hook = sys.excepthook
    previous = _previous_hook

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if record is not None:  # for the next attempt's crash-loop check
            record(f"{tp.__name__}: {value}")
        if on_failure is not None:
            on_failure()
        previous(tp, value, tb)
        _stderr(f"torchrig: rank {rank} of {world_size} failed with {tp.__name__}: {value}\n")
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and isinstance(value, Exception):
            try:
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                try:  # the handler reads the traceback of the exception being handled
                    raise value
                except Exception as err:
                    get_error_handler().record_exception(err)
            except Exception:
                traceback.print_exc()

    sys.excepthook = hook


def _spawn_worker(local_rank: int, call: bytes | _Call, base: dict[str, Any], result_path: str) -> None:
    n, node_rank = base["num_processes"], base["node_rank"]
    global_rank = node_rank * n + local_rank
    os.environ.update(
        rank_env(
            global_rank=global_rank,
            local_rank=local_rank,
            node_rank=node_rank,
            world_size=n * base["num_nodes"],
            local_world_size=n,
            addr=base["addr"],
            port=base["port"],
        )
    )
    limit_threads(base["threads"])
    import pickle

    fn, args, kwargs = pickle.loads(call) if isinstance(call, bytes) else call  # our own bytes, see spawn()
    result = fn(*args, **kwargs)
    if global_rank == 0:
        # A file, not a multiprocessing queue: a queue's pipe blocks a large result until the parent
        # reads it (which it does only after joining), and its shared-memory tensors die with the worker.
        try:
            payload = pickle.dumps(result)
        except Exception as err:  # an unpicklable result must not fail a finished run
            _stderr(f"torchrig: the return value of rank 0 could not be sent back ({err}); returning None\n")
            payload = pickle.dumps(None)
        with open(result_path + ".tmp", "wb") as f:
            f.write(payload)
        os.replace(result_path + ".tmp", result_path)


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    num_processes: int,
    num_nodes: int,
    start_method: str,
) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``num_processes`` new processes; returns rank 0's result.

    ``fn`` and its arguments must be picklable for ``start_method="spawn"`` (define ``fn`` at module
    level). If a worker raises, the others are stopped and the error is raised here.

    Every worker works on its own copy of the tensors in ``fn``, ``args`` and ``kwargs`` (a module
    built here, its optimizer...), as a process started by ``ddp`` or torchrun does. For ``spawn``
    they are pickled here once with the standard pickler, which copies a tensor's data, and each
    worker unpickles its own copy: ``torch.multiprocessing``'s pickler would instead move every CPU
    tensor to shared memory (this process's too), so all workers would update one set of weights.
    A ``fork`` worker's memory is already its own (copy-on-write).
    """
    call: bytes | _Call
    if start_method == "fork":
        _check_fork_safe()
        call = (fn, args, kwargs)
    else:
        call = _pickled(fn, args, kwargs)
    addr, port, node_rank = _rendezvous(num_nodes)
    base = {
        "num_processes": num_processes,
        "num_nodes": num_nodes,
        "node_rank": node_rank,
        "addr": addr,
        "port": port,
        "threads": spawned_threads(num_processes),
    }
    import pickle
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="torchrig-spawn-")
    result_path = os.path.join(tmp, "rank0.pkl")
    try:
        try:
            mp.start_processes(
                _spawn_worker, args=(call, base, result_path), nprocs=num_processes, start_method=start_method
            )
        except mp.ProcessExitedException as err:
            if not stopped_for_signal(err.exit_code):
                raise
            # The workers stopped together for a signal after saving (torchrig.Preempted): so does this one.
            code = err.exit_code
            raise Preempted(-code if code < 0 else code - 128) from None
        if not os.path.exists(result_path):
            return None
        with open(result_path, "rb") as f:
            return pickle.load(f)  # written just now by our own worker, in our own private directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pickled(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` as bytes (tensors copied), or a TypeError that says what cannot be sent."""
    import pickle

    target = getattr(fn, "args", (None, fn))[1] if hasattr(fn, "func") else fn  # Rig.launch's partial
    try:
        pickle.dumps(target)
    except Exception as err:
        name = getattr(target, "__qualname__", repr(target))
        raise TypeError(
            f"strategy='ddp_spawn' sends the function to new processes by pickling it, and {name} cannot be "
            f"pickled ({err}). Define it at module level (not a lambda or a nested function), or use "
            "strategy='ddp_notebook' (fork) or strategy='ddp' (re-runs the script)"
        ) from err
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise TypeError(
            f"strategy='ddp_spawn' sends the function's arguments to new processes by pickling them, and one "
            f"of them cannot be pickled ({err}). Pass picklable arguments (build the object inside the "
            "function instead), or use strategy='ddp_notebook' (fork) or strategy='ddp' (re-runs the script)"
        ) from err


def _check_fork_safe() -> None:
    for device_type in ("cuda", "xpu"):
        mod = device_module(device_type)
        initialized = getattr(mod, "is_initialized", None)
        if callable(initialized) and initialized():
            raise RuntimeError(
                f"strategy='ddp_notebook' forks the processes, but {device_type} is already initialised in "
                "this process and cannot be used after a fork. Restart the kernel and do not touch the "
                f"device (no tensors on {device_type}, no torch.{device_type} calls) before rig.launch(); "
                "or use strategy='ddp_spawn' from a script"
            )
