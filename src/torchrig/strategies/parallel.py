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
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchrig.strategies.base import Strategy, check_reduce_op
from torchrig.strategies.environment import ClusterEnvironment, detect_environment
from torchrig.strategies.launch import SubprocessLauncher, install_failure_report, spawn, watch_parent

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

    distributed = True
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
                raise RuntimeError(
                    f"strategy={self.name!r} with start_method={self.start_method!r} starts its processes in "
                    "rig.launch(fn); call rig.launch(fn) instead of using the Rig directly"
                )
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
            env.global_rank, env.world_size, (lambda: launcher.kill(grace=2.0)) if launcher else None
        )
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
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
        init = "env://" if env.kind == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=self.timeout)

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
        from torch.utils.data import DistributedSampler

        sampler = getattr(loader, "sampler", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, DistributedSampler) and not isinstance(
            getattr(batch_sampler, "sampler", None), DistributedSampler
        ):
            warnings.warn(
                f"prepare() cannot shard this DataLoader (its {type(sampler).__name__} / dataset is not one it can "
                f"rebuild), so each of the {self.world_size} processes iterates all of it. Shard it yourself "
                "(torch.utils.data.DistributedSampler(dataset), or split an IterableDataset by rank)",
                stacklevel=4,
            )
        return loader

    def _destroy_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            # DDP's reducer and hooks form reference cycles that keep the process group (and the
            # backend's worker threads) alive until a garbage collection. Collect them now, while
            # the interpreter is whole: freed during interpreter shutdown instead, gloo's threads
            # can abort the process ("terminate called without an active exception") at exit.
            gc.collect()
            dist.destroy_process_group()
        self._owns_group = False

    def teardown(self) -> None:
        self._destroy_group()
        super().teardown()

    # -- collectives ------------------------------------------------------------------------
    def _active(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Stack ``tensor`` from every rank: ``(world_size, *shape)``; same shape on every rank."""
        if not self._active():
            return tensor.unsqueeze(0)
        if sync_grads:
            from torch.distributed.nn.functional import all_gather

            with warnings.catch_warnings():  # torch 2.13 nudges to a private module; this one is public
                warnings.simplefilter("ignore", FutureWarning)
                return torch.stack(all_gather(tensor.contiguous()))
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor.contiguous())
        return torch.stack(out)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a copy of ``tensor`` across ranks (the input is left as it was)."""
        check_reduce_op(op)
        if not self._active():
            return tensor
        out = tensor.clone() if tensor.is_floating_point() or op != "mean" else tensor.double()
        dist.all_reduce(out, op=_OPS[op])
        if op == "mean":
            out = out / dist.get_world_size()
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """A tensor (same shape and dtype on every rank) or any picklable object from rank ``src``."""
        if not self._active():
            return obj
        if isinstance(obj, torch.Tensor):
            out = obj.clone()
            dist.broadcast(out, src=src)
            return out
        box = [obj]
        device = self.root_device if self.backend() not in ("gloo",) else None
        dist.broadcast_object_list(box, src=src, device=device)
        return box[0]

    def barrier(self, name: str | None = None) -> None:
        if not self._active():
            return
        if self.backend() == "nccl" and self.root_device.index is not None:
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def reduce_boolean_decision(self, flag: bool, all: bool = True) -> bool:
        if not self._active():
            return bool(flag)
        votes = torch.tensor(int(bool(flag)), device=self.root_device)
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
