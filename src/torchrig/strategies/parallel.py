"""``ParallelStrategy``: process-group set-up, launching and collectives shared by DDP and FSDP.

Everything goes through ``torch.distributed``: the backend comes from
``torch.distributed.Backend.default_device_backend_map`` (gloo for CPU, nccl for CUDA, xccl for
XPU), and every collective is a ``torch.distributed`` call. With one process the collectives are
identities and cost nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchrig.clusters import ClusterEnvironment, detect_environment
from torchrig.dtensors import whole
from torchrig.strategies.base import Strategy, check_reduce_op
from torchrig.strategies.hangs import collective
from torchrig.strategies.launch import (
    SubprocessLauncher,
    install_failure_report,
    launch_first,
    spawn,
    watch_parent,
)
from torchrig.strategies.shutdown import settle_at_exit

START_METHODS = ("popen", "spawn", "fork")
#: PyTorch's own default process-group timeout.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class ParallelStrategy(Strategy):
    """Several processes in one ``torch.distributed`` process group (the base of DDP and FSDP).

    Args:
        process_group_backend: ``"gloo"``, ``"nccl"``, ``"xccl"``...; default: PyTorch's backend
            for the device type.
        timeout: how long a collective waits for the other ranks before failing.
        start_method: how processes are started when no launcher (torchrun, SLURM) did:
            ``"popen"`` re-runs the script, ``"spawn"``/``"fork"`` start ``rig.launch(fn)`` workers.
    """

    #: Strategy name used in messages.
    name = "parallel"

    def __init__(
        self,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__()
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not one of {', '.join(START_METHODS)}")
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout={timeout!r} must be a datetime.timedelta, e.g. timedelta(minutes=5)")
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.start_method = start_method
        self._env: ClusterEnvironment | None = None
        self._launcher: SubprocessLauncher | None = None
        self._owns_group = False
        #: torchrun's job-wide store and this attempt's number, when torchrun restarts workers.
        self._job_store: Any = None
        self._attempt = 0

    # -- layout ---------------------------------------------------------------------------
    @property
    def cluster(self) -> ClusterEnvironment:
        """The launcher environment (fixed once the process group is joined)."""
        return self._env if self._env is not None else detect_environment()

    @property
    def num_processes(self) -> int:
        """Processes per machine when torchrig starts them: one per device."""
        return len(self.parallel_devices)

    @property
    def global_rank(self) -> int:
        return self.cluster.global_rank

    @property
    def local_rank(self) -> int:
        return self.cluster.local_rank

    @property
    def node_rank(self) -> int:
        return self.cluster.node_rank

    @property
    def world_size(self) -> int:
        env = self.cluster
        return env.world_size if env.launched else self.num_processes * self.num_nodes

    @property
    def root_device(self) -> torch.device:
        local, devices = self.local_rank, self.parallel_devices
        if local < len(devices):
            return devices[local]
        if devices[0].type == "cpu":  # a launcher decides how many CPU processes there are
            return torch.device("cpu")
        raise ValueError(
            f"this is local rank {local}, but devices= gives only {len(devices)} {devices[0].type} device(s) "
            f"per machine: {[str(d) for d in devices]}. Start as many processes per machine as devices "
            f"(torchrun --nproc-per-node {len(devices)}), or pass devices= to match the launcher"
        )

    @property
    def needs_launch(self) -> bool:
        """True until ``rig.launch`` starts the workers (``spawn``/``fork`` without a launcher)."""
        return self.start_method != "popen" and not self.cluster.launched

    def backend(self) -> str:
        """The process-group backend for this run's device type."""
        if not dist.is_available():
            raise RuntimeError(f"strategy={self.name!r} needs torch.distributed, which this PyTorch build lacks")
        if self.process_group_backend:
            return self.process_group_backend
        device_type = self.parallel_devices[0].type
        backend = dist.Backend.default_device_backend_map.get(device_type)
        if backend is None:
            known = ", ".join(f"{k} -> {v}" for k, v in dist.Backend.default_device_backend_map.items())
            raise ValueError(
                f"strategy={self.name!r} needs a torch.distributed backend for {device_type!r} devices, but "
                f"PyTorch has none registered (it knows {known}). Register one with "
                f"torch.distributed.Backend.register_backend(name, fn, devices=[{device_type!r}]), pass "
                f"process_group_backend= to the strategy, or run one process with strategy='single'"
            )
        return str(backend)

    # -- life cycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Start the other ranks if nobody did, join the process group, select the device."""
        backend = self.backend()
        env = detect_environment()
        if not env.launched:
            if self.start_method != "popen":
                raise RuntimeError(launch_first(self, "joining the process group"))
            self._launcher = SubprocessLauncher(
                num_processes=self.num_processes,
                num_nodes=self.num_nodes,
                timeout=self.timeout,
            )
            env = self._launcher.start()
        self._env = env
        watch_parent()
        launcher = self._launcher
        # On failure give the other ranks a moment to fail by themselves (so they report it), then stop them.
        install_failure_report(
            env.global_rank,
            env.world_size,
            (lambda: launcher.kill(grace=2.0)) if launcher else None,
            record=self.record_failure,
        )
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        settle_at_exit()  # registered before _destroy_group below, so it runs after it
        if not dist.is_initialized():
            self._init_process_group(backend, env)
            self._owns_group = True
            atexit.register(self._destroy_group)
        elif dist.get_world_size() != env.world_size:
            raise RuntimeError(
                f"a process group of {dist.get_world_size()} processes already exists, but this run has "
                f"{env.world_size}; destroy it first (torch.distributed.destroy_process_group())"
            )

    def _init_process_group(self, backend: str, env: ClusterEnvironment) -> None:
        rank, world = env.global_rank, env.world_size
        store = self._launcher.store if self._launcher is not None else None
        if store is not None:  # rank 0 hosts the store it opened before starting the others
            # The same key prefix init_process_group gives the store it makes for the other ranks.
            prefixed = dist.PrefixStore("default_pg", store)
            dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=self.timeout)
            return
        if env.kind == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            # torchrun's agent hosts one store for the whole job and keeps it across restarts
            # (--max-restarts), but env:// gives every attempt the same keys: a restarted rank can
            # read the address a dead rank of the previous attempt published and connect to it
            # (pytorch#135712, #167288). The keys of each attempt get their own prefix.
            assert env.master_addr is not None and env.master_port is not None
            self._attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            self._job_store = dist.TCPStore(
                env.master_addr, env.master_port, world, is_master=False, timeout=self.timeout
            )
            check_progress(self._job_store, self._attempt, rank)
            attempt_store = dist.PrefixStore(f"torchrig/attempt_{self._attempt}/default_pg", self._job_store)
            dist.init_process_group(backend, store=attempt_store, rank=rank, world_size=world, timeout=self.timeout)
            return
        if env.kind != "torchrun" and (env.master_addr is None or not env.master_port):
            raise ValueError(
                f"the {env.kind} launcher gave rank {rank} of {world} no rendezvous address "
                f"(MASTER_ADDR={env.master_addr}, MASTER_PORT={env.master_port}); set MASTER_ADDR to rank 0's "
                "host and MASTER_PORT to a free port for every process (mpirun -x MASTER_ADDR=host -x MASTER_PORT=port)"
            )
        init = "env://" if env.kind == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=self.timeout)

    def record_progress(self) -> None:
        """Note in torchrun's job-wide store that this attempt committed a checkpoint (see
        :func:`check_progress`); nothing to do without torchrun restarts."""
        if self._job_store is not None:
            self._job_store.add(_progress_key(self._attempt), 1)

    def record_failure(self, text: str) -> None:
        """Keep the first error of this attempt in torchrun's job-wide store for the next attempt."""
        if self._job_store is not None:
            with contextlib.suppress(Exception):  # the store may be gone with the agent
                self._job_store.compare_set(_failure_key(self._attempt), "", f"rank {self.global_rank}: {text}")

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the ``spawn``/``fork`` workers and run ``fn`` in each; else just call ``fn``."""
        if not self.needs_launch:
            return fn(*args, **kwargs)
        self.backend()  # fail here, before starting processes, when no backend fits
        return spawn(
            fn,
            args,
            kwargs,
            num_processes=self.num_processes,
            num_nodes=self.num_nodes,
            start_method=self.start_method,
        )

    def process_dataloader(self, loader: Any) -> Any:
        """A loader ``prepare`` could not re-shard (custom sampler, iterable dataset): kept as is."""
        from torch.utils.data import DistributedSampler, IterableDataset

        sampler = getattr(loader, "sampler", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, DistributedSampler) and not isinstance(
            getattr(batch_sampler, "sampler", None), DistributedSampler
        ):
            dataset = getattr(loader, "dataset", None)
            if isinstance(dataset, IterableDataset):
                what = f"its {type(dataset).__name__} is an IterableDataset that does not say how to split itself"
                fix = (
                    f"give {type(dataset).__name__} a method shard_for_rank(rank, world_size) returning this rank's "
                    "share of the stream (a Hugging Face datasets.IterableDataset is split for you)"
                )
            else:
                what = f"its {type(sampler).__name__} / dataset is not one it can rebuild"
                fix = "torch.utils.data.DistributedSampler(dataset)"
            warnings.warn(
                f"prepare() cannot shard this DataLoader ({what}), so each of the {self.world_size} processes "
                f"reads the same data. Shard it yourself: {fix}",
                stacklevel=4,
            )
        return loader

    def _destroy_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            # DDP's reducer and hooks form reference cycles that keep the process group (and the
            # backend's worker threads) alive until a garbage collection: collect them now, so a
            # group nothing else holds is freed while the interpreter is whole. The threads of a
            # group still held (a live DDP module) are waited for by shutdown.settle_at_exit.
            gc.collect()
            dist.destroy_process_group()
        self._owns_group = False

    def teardown(self) -> None:
        self._destroy_group()
        super().teardown()

    # -- collectives ------------------------------------------------------------------------
    def _active(self, name: str) -> bool:
        """Whether the collective ``name`` has other ranks to talk to (False: it is the identity).
        Before ``rig.launch(fn)`` started the processes of a ``spawn``/``fork`` strategy (or in the
        process that called it) there are no ranks yet: an error, not a one-process answer."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size() > 1
        if self.needs_launch:
            raise RuntimeError(launch_first(self, f"the collective {name}"))
        return False

    def _collective(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Record the collective ``name`` for the report on a timeout (:mod:`.hangs`)."""
        return collective(name, self.global_rank, dist.get_world_size(), self.timeout)

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Stack ``tensor`` from every rank: ``(world_size, *shape)``; same shape on every rank."""
        if not self._active("all_gather"):
            return tensor.unsqueeze(0)
        tensor = whole(tensor)
        if sync_grads:
            from torch.distributed.nn.functional import all_gather

            with warnings.catch_warnings(), self._collective("all_gather"):
                warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 nudges to a private module
                return torch.stack(all_gather(tensor.contiguous()))
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        with self._collective("all_gather"):
            dist.all_gather(out, tensor.contiguous())
        return torch.stack(out)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a copy of ``tensor`` across ranks (the input is left as it was)."""
        check_reduce_op(op)
        if not self._active("all_reduce"):
            return tensor
        tensor = whole(tensor)
        out = tensor.clone() if tensor.is_floating_point() or op != "mean" else tensor.double()
        with self._collective(f"all_reduce({op!r})"):
            dist.all_reduce(out, op=_OPS[op])
        if op == "mean":
            out = out / dist.get_world_size()
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if not self._active("all_gather_object"):
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """A tensor (same shape and dtype on every rank) or any picklable object from rank ``src``."""
        if not self._active("broadcast"):
            return obj
        if isinstance(obj, torch.Tensor):
            out = whole(obj).clone()
            with self._collective(f"broadcast(src={src})"):
                dist.broadcast(out, src=src)
            return out
        box = [obj]
        device = self.root_device if self.backend() not in ("gloo",) else None
        with self._collective(f"broadcast(src={src})"):
            dist.broadcast_object_list(box, src=src, device=device)
        return box[0]

    def barrier(self, name: str | None = None) -> None:
        if not self._active("barrier"):
            return
        with self._collective("barrier" if name is None else f"barrier({name!r})"):
            if self.backend() == "nccl" and self.root_device.index is not None:
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def reduce_boolean_decision(self, flag: bool, all: bool = True) -> bool:
        if not self._active("reduce_boolean_decision"):
            return bool(flag)
        votes = torch.tensor(int(bool(flag)), device=self.root_device)
        with self._collective("reduce_boolean_decision"):
            dist.all_reduce(votes, op=dist.ReduceOp.SUM)
            count = int(votes.item())  # a decision is needed on the host
        return count == dist.get_world_size() if all else count > 0

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        if self.global_rank != 0:
            self.barrier("rank_zero_first")
        yield
        if self.global_rank == 0:
            self.barrier("rank_zero_first")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(start_method={self.start_method!r})"


def _progress_key(attempt: int) -> str:
    return f"torchrig/progress/attempt_{attempt}"


def _failure_key(attempt: int) -> str:
    return f"torchrig/failure/attempt_{attempt}"


class CrashLoopError(RuntimeError):
    """A torchrun restart would repeat a failed attempt that made no progress."""


def check_progress(store: Any, attempt: int, rank: int) -> None:
    """Stop a crash loop: raise :class:`CrashLoopError` when the previous attempt was a restart
    (``attempt >= 2``) that committed no checkpoint (no ``rig.save`` completed in it), and the
    attempt before that committed none either.

    Progress is the number of checkpoints committed through ``rig.save`` in an attempt, counted
    in torchrun's job-wide store. The first run and the first restart always run, and so does
    every restart after an attempt with progress or after one that came after progress: a run
    may fail before its next checkpoint once; twice in a row means the restart cannot help.
    """
    if attempt < 2 or store.check([_progress_key(attempt - 1)]) or store.check([_progress_key(attempt - 2)]):
        return
    stopped = "torchrig/crash_loop"
    if not store.check([stopped]):
        failure = _failure_key(attempt - 1)
        cause = store.get(failure).decode() if store.check([failure]) else ""
        cause = cause or "a rank died without recording an error (killed by a signal? see the output above)"
        text = (
            f"restart {attempt - 1} committed no checkpoint before it failed, like the attempt before it, "
            f"so restarting again would repeat it; the job stops here. Restart {attempt - 1} failed with "
            f"{cause}"
        )
        if store.compare_set(stopped, "", text).decode() == text:
            stop_torchrig_run(text)
    raise CrashLoopError(f"rank {rank}: torchrig run --max-restarts: {store.get(stopped).decode()}")


#: Set by ``torchrig run``: where a worker leaves the reason it stops the whole job.
STOP_FILE_ENV = "TORCHRIG_RUN_STOP_FILE"


def stop_torchrig_run(reason: str) -> None:
    """Under ``torchrig run``, write ``reason`` to its stop file and SIGTERM the agent (this
    worker's parent), so torchrun stops instead of spending its remaining restarts."""
    import signal

    path = os.environ.get(STOP_FILE_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(reason)
        os.kill(os.getppid(), signal.SIGTERM)
