"""``torchrig.plan``: what every rank of an N-D parallel job holds, computed in one process.

The model is built on ``meta`` (no memory), and :class:`~torchrig.ModelParallelStrategy`'s own
set-up (tensor-parallel plan, then FSDP2 over the data-parallel dimensions) is applied to it once
per rank, each time inside PyTorch's fake process group (``init_process_group("fake")``: every
collective returns at once, no devices, no network). What each rank gets is read from its
DTensors: every parameter's local shard shape and placements, and from those the bytes per rank
of parameters, gradients and AdamW state in the chosen precision. It answers "will my 8B model
fit on 64 GPUs with tp=8?" before a job is submitted.

With pipeline parallel, each rank holds the parameters of its stage(s) only; the plan names each
rank's stages and their modules, how many microbatches' activations the schedule keeps in flight
on it, and the schedule's bubble (the share of a step a rank idles, from the textbook formula
``(pp - 1) / (v * microbatches + pp - 1)`` with ``v`` stages per rank, equal forward and backward
times; an upper bound for the zero-bubble schedule).

Not counted: the bytes of activations (they depend on the input: run a step with ``step_input``),
the parameters FSDP2 gathers for one layer's forward/backward, buffers, and the allocator's and
communication buffers' overheads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchrig import arguments, parallel
from torchrig.plan_report import ParallelPlan, RankPlan, ShardInfo


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """PyTorch's fake process group as the default group for the block: collectives return at once."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "torchrig.plan() runs the job's ranks in a fake process group, but this process already joined a real "
            "one; call it from a plain Python process (or `torchrig plan`)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dtypes(precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype parameters, gradients and AdamW state are stored in, the compute dtype of mixed precision)."""
    from torchrig.precision import _MIXED_DTYPES, _TRUE_DTYPES, normalize_precision

    name = normalize_precision(precision)
    if name not in _TRUE_DTYPES and name not in _MIXED_DTYPES:
        known = ", ".join(sorted({*_TRUE_DTYPES, *_MIXED_DTYPES}))
        raise ValueError(f"precision={precision!r} is not one the planner sizes; use one of {known}")
    return _TRUE_DTYPES.get(name) or torch.float32, _MIXED_DTYPES.get(name)


def plan(
    model_fn: Callable[[], nn.Module],
    *,
    world_size: int,
    data_parallel_replicate: int = 1,
    data_parallel_shard: int | str = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    pp_schedule: str | type = "1F1B",
    pp_microbatches: int | None = None,
    pp_split: list[str] | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    parallelize: Callable[[nn.Module, Any], nn.Module] | None = None,
    auto_wrap_policy: Any = None,
    precision: str = "bf16-mixed",
    ranks: Iterable[int] | None = None,
    applied_ranks: Iterable[int] = (0,),
    step_input: Callable[[], Any] | None = None,
) -> ParallelPlan:
    """Plan a ``world_size``-rank :class:`~torchrig.ModelParallelStrategy` job in this one process.

    For each rank of ``applied_ranks``, ``model_fn()`` is called under ``torch.device("meta")``
    and the strategy's own set-up is applied to it as that rank, in a fake process group of
    ``world_size`` ranks. Placements are the same on every rank (SPMD), so the other ranks of
    ``ranks`` (default: all) get their local shapes from those placements at their own mesh
    coordinates, splitting as DTensor and FSDP2 do (``torch.chunk``, uneven splits included;
    checked against DTensor's ``to_local()`` on every applied rank); pass
    ``applied_ranks=range(world_size)`` to apply the strategy on every rank instead (slower).
    With ``step_input`` (a function returning the model's input), each applied rank also runs a
    forward and a backward (of the sum of the first output tensor) on fake tensors
    (``FakeTensorMode``: shapes only, no memory, no compute): a plan whose shards do not fit
    the model's forward (a head count the tensor-parallel size does not divide) fails here.
    A ``parallelize`` whose meshes have dimensions other than the strategy's is applied on
    every planned rank. With ``pipeline_parallel``, the strategy is applied once per stage (at the
    applied ranks' places in each stage's slice of the mesh), and ``step_input`` is not run (a
    stage alone cannot run the model's forward). Bytes: parameters and gradients in the
    precision's parameter dtype (fp32 for ``*-mixed``), AdamW's two moments in the same dtype.

    Example:
        >>> from torchrig.demo.transformer import tiny
        >>> p = plan(tiny, world_size=4, tensor_parallel=2, ranks=[0])
        >>> p.mesh_sizes
        {'pp': 1, 'dp_replicate': 1, 'dp_shard': 2, 'tp': 2}
        >>> [s.local_shape for s in p.ranks[0].params if s.name == "layers.0.mlp.up.weight"]
        [(32, 32)]
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from torchrig.strategies.model_parallel import ModelParallelStrategy

    arguments.int_in_range("world_size", world_size, 1, hint=" (devices x num_nodes)")
    store_dtype, compute_dtype = _dtypes(precision)
    strategy = ModelParallelStrategy(
        pipeline_parallel=pipeline_parallel,
        pp_schedule=pp_schedule,
        pp_microbatches=pp_microbatches,
        pp_split=pp_split,
        parallelize=parallelize,
        data_parallel_replicate=data_parallel_replicate,
        data_parallel_shard=data_parallel_shard,
        tensor_parallel=tensor_parallel,
        tp_plan=tp_plan,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None
        ),
    )
    sizes = strategy.mesh_sizes(world_size)
    chosen = list(range(world_size)) if ranks is None else sorted(set(ranks))
    applied = sorted(set(applied_ranks))
    bad = [r for r in (*chosen, *applied) if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks={bad} are not ranks of a {world_size}-rank job (0 to {world_size - 1})")
    mesh_sizes = dict(zip(parallel.MESH_DIMS, sizes, strict=True))
    out = ParallelPlan(world_size=world_size, mesh_sizes=mesh_sizes, precision=precision, numel=0)
    itemsize = torch.empty(0, dtype=store_dtype).element_size()
    start = time.perf_counter()
    layouts: dict[int, list[_Param]] = {}
    stages: dict[int, _Stage] = {}  # pipeline coordinate -> what its ranks run
    per_stage = world_size // sizes[0]  # the ranks of one pipeline stage's slice of the mesh
    applied = sorted({p * per_stage + r % per_stage for r in applied or chosen[:1] for p in range(sizes[0])})
    for rank in applied:
        layouts[rank], out.numel, shape, stage = _apply(
            strategy, model_fn, rank, world_size, sizes, store_dtype, step_input
        )
        if shape is not None:
            out.step_outputs[rank] = shape
        if stage is not None:
            stages[rank // per_stage] = stage
    templates = {rank // per_stage: layout for rank, layout in layouts.items()}
    if not all(set(p.dims) <= set(parallel.MESH_DIMS) for t in templates.values() for p in t):  # users' own meshes
        for rank in chosen:
            if rank not in layouts:
                layouts[rank], _, _, _ = _apply(strategy, model_fn, rank, world_size, sizes, store_dtype, None)
    if stages:
        first = next(iter(stages.values()))
        out.schedule, out.microbatches, out.bubble = first.schedule, first.microbatches, first.bubble
    for rank in chosen:
        coords = _coordinates(rank, sizes)
        params = layouts.get(rank) or templates[rank // per_stage]
        stage = stages.get(rank // per_stage)
        shards = [p.at(coords) for p in params]
        trainable = sum(s.local_numel for s, p in zip(shards, params, strict=True) if p.requires_grad)
        held = sum(s.local_numel for s in shards)
        out.ranks.append(
            RankPlan(
                rank=rank,
                coordinates=coords,
                params=shards,
                param_bytes=held * itemsize,
                grad_bytes=trainable * itemsize,
                optimizer_bytes=2 * trainable * itemsize,
                stages=stage.indices if stage else (),
                stage_modules=stage.modules if stage else (),
                in_flight=stage.in_flight if stage else 0,
            )
        )
    out.seconds = time.perf_counter() - start
    return out


def _coordinates(rank: int, sizes: tuple[int, ...]) -> dict[str, int]:
    """Where ``rank`` sits in the row-major ``(pp, dp_replicate, dp_shard, tp)`` mesh."""
    coords = {}
    for name, size in zip(reversed(parallel.MESH_DIMS), reversed(sizes), strict=True):
        rank, coords[name] = divmod(rank, size)
    return {d: coords[d] for d in parallel.MESH_DIMS}


@dataclass(frozen=True)
class _Stage:
    """The pipeline stages one rank runs, as the strategy cut them."""

    indices: tuple[int, ...]
    modules: tuple[str, ...]
    in_flight: int
    schedule: str
    microbatches: int
    bubble: float


def _stage_of(model: nn.Module) -> _Stage | None:
    from torchrig.pipelining import pipeline_of, stages_per_rank

    pipeline = pipeline_of(model)
    if pipeline is None:
        return None
    pp = pipeline.num_stages // stages_per_rank(pipeline.schedule_cls)
    v, m = stages_per_rank(pipeline.schedule_cls), pipeline.microbatches
    first = pipeline.stage_indices[0]
    # GPipe runs every forward before any backward; 1F1B-style schedules start the backward of a
    # microbatch after the stages below have their own forwards in flight.
    gpipe = pipeline.schedule_cls.__name__ == "ScheduleGPipe"
    in_flight = m if gpipe else min(m, v * (pp - first))
    return _Stage(
        indices=tuple(pipeline.stage_indices),
        modules=tuple(n for s in pipeline.stage_indices for n in pipeline.split.module_names(s)),
        in_flight=in_flight,
        schedule=pipeline.schedule_cls.__name__,
        microbatches=m,
        bubble=(pp - 1) / (v * m + pp - 1),
    )


@dataclass(frozen=True)
class _Param:
    """One parameter as the strategy left it on some rank: enough to know its shard on any rank."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Any, ...]
    dtype: str
    requires_grad: bool

    def at(self, coords: dict[str, int]) -> ShardInfo:
        if not self.dims:
            return ShardInfo(self.name, self.shape, self.shape, "whole", self.dtype)
        local = _local_shape(self.shape, self.mesh_shape, [coords[d] for d in self.dims], self.placements)
        where = ", ".join(f"{d}:{pl}" for d, pl in zip(self.dims, self.placements, strict=True))
        return ShardInfo(self.name, self.shape, local, where, self.dtype)


def _local_shape(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coords: list[int], placements: Any
) -> tuple[int, ...]:
    """The shard a rank at ``coords`` holds: ``torch.chunk`` per sharded mesh dimension, as DTensor and FSDP2 split.

    Plain ``Shard`` placements apply outermost first; a ``_StridedShard`` (FSDP2 over a tensor-parallel
    parameter) splits what the dimensions after it left, so it applies after them.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    order = [i for i, pl in enumerate(placements) if not isinstance(pl, _StridedShard)]
    order += [i for i, pl in reversed(list(enumerate(placements))) if isinstance(pl, _StridedShard)]
    local = list(shape)
    for i in order:
        pl = placements[i]
        if isinstance(pl, (Shard, _StridedShard)):
            n, k = local[pl.dim], mesh_shape[i]
            size = -(-n // k)
            local[pl.dim] = max(0, min(size, n - coords[i] * size))
    return tuple(local)


def _apply(
    strategy: Any,
    model_fn: Callable[[], nn.Module],
    rank: int,
    world_size: int,
    sizes: Any,
    dtype: torch.dtype,
    step_input: Callable[[], Any] | None,
) -> tuple[list[_Param], int, tuple[int, ...] | None, _Stage | None]:
    """The strategy's set-up of a fresh meta model as ``rank``: every parameter, the model's size,
    the output shape of a fake forward/backward when ``step_input`` is given, and its pipeline stages."""
    from torch.distributed.tensor import DTensor

    coords = _coordinates(rank, sizes)
    with fake_process_group(rank, world_size):
        strategy._mesh = parallel.init_mesh("cpu", sizes)
        try:
            with torch.device("meta"):
                model = model_fn()
            if not isinstance(model, nn.Module):
                raise TypeError(f"model_fn() returned a {type(model).__name__}; it must return an nn.Module")
            model = model.to(dtype=dtype) if dtype != torch.float32 else model
            numel = sum(p.numel() for p in model.parameters())
            model = strategy._parallelize(model)
            params = []
            for name, p in model.named_parameters():
                kind = str(p.dtype).removeprefix("torch.")
                if isinstance(p, DTensor):
                    mesh = p.device_mesh
                    dims = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
                    local = tuple(p.to_local().shape)
                    placements = tuple(p.placements)
                    param = _Param(name, tuple(p.shape), dims, tuple(mesh.shape), placements, kind, p.requires_grad)
                    if set(dims) <= set(parallel.MESH_DIMS) and param.at(coords).local_shape != local:
                        raise RuntimeError(f"planner: derived shard of {name} differs from DTensor's {local}")
                else:
                    param = _Param(name, tuple(p.shape), (), (), (), kind, p.requires_grad)
                params.append(param)
            stage = _stage_of(model)
            shape = None if step_input is None or stage is not None else _fake_step(model, step_input, rank)
        finally:
            strategy._mesh = None
    return params, numel, shape, stage


def _fake_step(model: nn.Module, step_input: Callable[[], Any], rank: int) -> tuple[int, ...]:
    """Forward and backward of ``model`` on fake tensors (shapes only); the output's shape."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")  # FSDP2 and DTensor warn about running on CPU / fake tensors
        model.to_empty(device="cpu")
        args = step_input()
        try:
            out = model(*args) if isinstance(args, tuple) else model(args)
            found = out if isinstance(out, torch.Tensor) else _first_tensor(out)
            if found is None:
                raise TypeError(f"the model's forward returned a {type(out).__name__} without a tensor")
            found.float().sum().backward()
        except Exception as err:
            raise RuntimeError(
                f"torchrig.plan: the forward/backward as rank {rank} failed under this plan (on fake tensors): "
                f"{type(err).__name__}: {err}"
            ) from err
        return tuple(found.shape)


def _first_tensor(obj: Any) -> torch.Tensor | None:
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        found = v if isinstance(v, torch.Tensor) else _first_tensor(v)
        if found is not None and found.is_floating_point():
            return found
    return None
