"""Building blocks of N-D parallelism on a ``DeviceMesh``, as plain functions.

:class:`~torchrig.ModelParallelStrategy` calls these when it is given no ``parallelize``
function; a ``parallelize(model, mesh)`` of your own can call them too::

    def parallelize(model, mesh):
        torchrig.parallel.apply_tp(model, mesh["tp"], {"layers.*.attn.qkv": "colwise", ...})
        torchrig.parallel.apply_fsdp(model, torchrig.parallel.data_parallel_mesh(mesh), wrap_policy={Block})
        return model

The mesh always has the four named dimensions of :data:`MESH_DIMS` (size 1 where unused);
:func:`apply_pp` (pipeline stages over ``mesh["pp"]``) comes first, then tensor parallel and FSDP
on this rank's stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchrig import arguments
from torchrig.pipelining import Pipeline as Pipeline
from torchrig.pipelining import apply_pp as apply_pp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

#: The names of the mesh dimensions, outermost first: pipeline stages, HSDP replicas, FSDP shards, tensor parallel.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

WrapPolicy = Callable[[nn.Module], bool]


def mesh_sizes(
    world_size: int,
    *,
    data_parallel_replicate: int,
    data_parallel_shard: int | str,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
) -> tuple[int, int, int, int]:
    """``(pp, dp_replicate, dp_shard, tp)`` for ``world_size`` processes; ``"auto"`` shard takes what is left.

    Raises ValueError, with the arithmetic and a size that works, when they do not multiply to
    ``world_size``.

    Example:
        >>> mesh_sizes(8, data_parallel_replicate=1, data_parallel_shard="auto", tensor_parallel=2)
        (1, 1, 4, 2)
    """
    check_sizes(data_parallel_replicate, data_parallel_shard, tensor_parallel, pipeline_parallel)
    auto = data_parallel_shard == "auto"
    other = pipeline_parallel * data_parallel_replicate * tensor_parallel
    named = f"data_parallel_replicate={data_parallel_replicate} x tensor_parallel={tensor_parallel}"
    if pipeline_parallel > 1:
        named = f"pipeline_parallel={pipeline_parallel} x {named}"
    if auto:
        if world_size % other:
            raise ValueError(
                f"data_parallel_shard='auto' takes what {named} = {other} leave of the world size {world_size}, but "
                f"{world_size} is not a multiple of {other}; "
                f"{_valid_choice(world_size, tensor_parallel, pipeline_parallel)}"
            )
        return pipeline_parallel, data_parallel_replicate, world_size // other, tensor_parallel
    shard = int(data_parallel_shard)
    if other * shard != world_size:
        pp = f"pipeline_parallel={pipeline_parallel} x " if pipeline_parallel > 1 else ""
        raise ValueError(
            f"{pp}data_parallel_replicate={data_parallel_replicate} x data_parallel_shard={shard} x "
            f"tensor_parallel={tensor_parallel} = {other * shard}, but the world size is {world_size} "
            "(devices x num_nodes); the sizes must multiply to it. "
            f"{_valid_choice(world_size, tensor_parallel, pipeline_parallel)}"
        )
    return pipeline_parallel, data_parallel_replicate, shard, tensor_parallel


def check_sizes(
    data_parallel_replicate: Any, data_parallel_shard: Any, tensor_parallel: Any, pipeline_parallel: Any = 1
) -> None:
    """ValueError naming the argument that is not an int >= 1 (``data_parallel_shard`` may be ``"auto"``)."""
    for name, value in (
        ("data_parallel_replicate", data_parallel_replicate),
        ("data_parallel_shard", data_parallel_shard),
        ("tensor_parallel", tensor_parallel),
        ("pipeline_parallel", pipeline_parallel),
    ):
        if name == "data_parallel_shard" and value == "auto":
            continue
        arguments.int_in_range(name, value, 1, hint=" (or 'auto')" if name == "data_parallel_shard" else "")


def _valid_choice(world_size: int, tensor_parallel: int, pipeline_parallel: int = 1) -> str:
    pp = math.gcd(world_size, pipeline_parallel)  # the largest sizes <= the ones asked that fit
    tp = math.gcd(world_size // pp, tensor_parallel)
    shard = world_size // (pp * tp)
    if pp == 1:
        return (
            f"for example tensor_parallel={tp}, data_parallel_shard={shard}, data_parallel_replicate=1 "
            f"(1 x {shard} x {tp} = {world_size})"
        )
    return (
        f"for example pipeline_parallel={pp}, tensor_parallel={tp}, data_parallel_shard={shard}, "
        f"data_parallel_replicate=1 ({pp} x 1 x {shard} x {tp} = {world_size})"
    )


def init_mesh(device_type: str, sizes: tuple[int, int, int, int]) -> DeviceMesh:
    """The ``(pp, dp_replicate, dp_shard, tp)`` mesh over the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``(dp_replicate, dp_shard)`` (HSDP) when there are replicas, else ``dp_shard``."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def data_parallel_size(mesh: DeviceMesh) -> int:
    """How many different batches one step sees: ``dp_replicate x dp_shard``."""
    return mesh["dp_replicate"].size() * mesh["dp_shard"].size()


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This process's index among the data-parallel ranks (tensor-parallel peers share it)."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)
_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.Dropout, nn.RMSNorm)
_EMBEDDINGS: tuple[type[nn.Module], ...] = (nn.Embedding,)
_LINEARS: tuple[type[nn.Module], ...] = (nn.Linear,)
_ANY: tuple[type[nn.Module], ...] = (nn.Module,)


def _styles() -> dict[str, tuple[Callable[[], ParallelStyle] | None, tuple[type[nn.Module], ...]]]:
    """Each style name: how to make its ``ParallelStyle`` (None: nothing to split) and the module
    types it can split. The names of Hugging Face transformers' ``_tp_plan`` (its
    ``ALL_PARALLEL_STYLES``) are here too, each as the PyTorch style that splits and computes the same."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    gathered = lambda: ColwiseParallel(output_layouts=Replicate())  # noqa: E731
    whole_input = lambda: RowwiseParallel(input_layouts=Replicate())  # noqa: E731
    return {
        "colwise": (ColwiseParallel, _LAYERS),
        # the output gathered on every tensor-parallel rank
        "colwise_rep": (gathered, _LAYERS),
        # input and output sharded on the sequence dimension, around a sequence-parallel norm
        "colwise_seq": (lambda: ColwiseParallel(input_layouts=Shard(1)), _LAYERS),
        "rowwise": (RowwiseParallel, _LAYERS),
        "rowwise_seq": (lambda: RowwiseParallel(output_layouts=Shard(1)), _LAYERS),
        "sequence": (SequenceParallel, _NORMS),
        "sequence_parallel": (SequenceParallel, _NORMS),
        # a row-split layer that takes its whole input (token ids, or activations it slices itself)
        "rowwise_embedding": (whole_input, _LAYERS),
        "rowwise_seq_embedding": (lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), _LAYERS),
        # -- Hugging Face transformers' names --
        "colwise_gather_output": (gathered, _LAYERS),
        "embedding_rowwise": (whole_input, _EMBEDDINGS),  # vocabulary split, lookups summed
        "embedding_colwise": (gathered, _EMBEDDINGS),  # embedding dimension split, gathered
        "rowwise_split_input": (whole_input, _LINEARS),
        "rowwise_rep": (whole_input, _LINEARS),
        # a norm on this rank's heads (between a colwise and a rowwise layer): weights replicated,
        # their gradients summed over the ranks. Rows are normalised one by one, so the local
        # activation may be declared split along its first dimension, whichever it is split on.
        "replicated_with_grad_allreduce": (lambda: SequenceParallel(sequence_dim=0, use_local_output=True), _ANY),
        "replicate": (None, _ANY),  # left whole on every rank
    }


#: transformers' styles with no PyTorch ``ParallelStyle`` that computes the same: they need
#: transformers' own sharding code (fused or strided weights, expert layers, partial outputs).
_HF_ONLY = (
    "packed_colwise",
    "packed_rowwise",
    "moe_tp_experts",
    "moe_identity_expert",
    "grouped_gemm",  # registered when transformers' expert parallel module is imported
    "ep_dispatch_experts",
    "mla_kv_a_proj",
    "all_reduce",
    "local_params",
)


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, str | ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with its patterns expanded to module names and its style names made into styles.

    A key is a dotted module name whose parts may hold ``*`` (``"layers.*.attn.q"``). Raises
    ValueError for a key that names no module or a style name torchrig does not know, and TypeError
    for a named style on a module type it cannot split.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"tp_plan={plan!r} must be a non-empty dict of module name pattern -> style")
    styles = _styles()
    names = [(name, name.split("."), sub) for name, sub in model.named_modules() if name]
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if style in _HF_ONLY:
            raise ValueError(
                f"tp_plan[{pattern!r}] = {style!r} is a Hugging Face transformers style that no PyTorch "
                "ParallelStyle reproduces (it needs transformers' own sharding code); pass tp_plan= without "
                f"{pattern!r} (the module stays whole), a torch.distributed.tensor.parallel.ParallelStyle for "
                "it, or parallelize=fn(model, mesh)"
            )
        if not isinstance(style, ParallelStyle) and style not in styles:
            raise ValueError(
                f"tp_plan[{pattern!r}] = {style!r} is not a tensor-parallel style; use one of "
                f"{', '.join(styles)} or a torch.distributed.tensor.parallel.ParallelStyle"
            )
        parts = pattern.split(".")
        found = [
            (name, sub)
            for name, atoms, sub in names
            if len(atoms) == len(parts) and all(fnmatchcase(a, p) for a, p in zip(atoms, parts, strict=True))
        ]
        if not found:
            close = [n for n, _, _ in names if n.split(".")[-1] == parts[-1]][:3]
            hint = f" (modules named like it: {', '.join(close)})" if close else ""
            raise ValueError(
                f"tp_plan key {pattern!r} names no submodule of {type(model).__name__}{hint}; keys are module "
                "names as model.named_modules() gives them, with * for any one part (e.g. 'layers.*.mlp.up')"
            )
        for name, sub in found:
            if not isinstance(style, str):
                out[name] = style
                continue
            make, kinds = styles[style]
            if not isinstance(sub, kinds):
                raise TypeError(
                    f"tp_plan[{pattern!r}] = {style!r} cannot split {name} ({type(sub).__name__}): {style!r} "
                    f"takes {', '.join(t.__name__ for t in kinds)}. Leave it out of the plan (it stays "
                    "replicated) or pass a ParallelStyle written for it"
                )
            if style in ("rowwise", "rowwise_seq") and isinstance(sub, nn.Embedding):
                make = styles[f"{style}_embedding"][0]  # token ids come whole, not split like activations
            if make is not None:
                out[name] = make()
    return out


def collect_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The ``_tp_plan`` of ``model`` and of every submodule that has one, keys prefixed by where it sits.

    So a Hugging Face model (or the demo transformer) inside a ``TrainingModule`` brings its plan
    along: ``self.net._tp_plan = {"layers.*.mlp.up": ...}`` becomes ``{"net.layers.*.mlp.up": ...}``.
    None when no module has one.
    """
    plan: dict[str, Any] = {}
    for name, sub in model.named_modules():
        own = getattr(sub, "_tp_plan", None)
        if own:
            plan.update({f"{name}.{key}" if name else key: style for key, style in dict(own).items()})
    return plan or None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str | ParallelStyle]) -> nn.Module:
    """Split the modules ``plan`` names over ``tp_mesh`` with ``parallelize_module``; returns ``model``.

    Styles: ``"colwise"``, ``"rowwise"``, ``"colwise_rep"``,
    ``"sequence"``..., and the names Hugging Face models use in their ``_tp_plan``), or
    ``ParallelStyle`` instances; see :func:`resolve_tp_plan` for the keys.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = resolve_tp_plan(model, plan)
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, resolved)  # type: ignore[arg-type]
    return model


def as_wrap_policy(policy: Any) -> WrapPolicy | None:
    """A function ``module -> bool`` from layer classes, a function, or None."""
    from torchrig.strategies.fsdp import _as_policy

    return _as_policy(policy)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    wrap_policy: Iterable[type[nn.Module]] | WrapPolicy | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 ``fully_shard`` the submodules ``wrap_policy`` picks (innermost first), then ``model``.

    ``dp_mesh`` is 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP); parameters already split by
    :func:`apply_tp` become 2-D shards. Returns ``model``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = as_wrap_policy(wrap_policy)
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
        "offload_policy": offload_policy if offload_policy is not None else OffloadPolicy(),
        "reshard_after_forward": reshard_after_forward,
    }
    if policy is not None:
        for sub in reversed(list(model.modules())):  # innermost first, as fully_shard expects
            if sub is not model and policy(sub):
                fully_shard(sub, **kwargs)
    fully_shard(model, **kwargs)
    return model


def total_norm(grads: list[torch.Tensor], norm_type: float, pp_group: Any = None) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` together, a plain tensor equal on every rank.

    DTensor gradients may live on different meshes (FSDP2 shards a tensor-parallel weight over
    ``(dp_shard, tp)`` but a replicated norm's weight over ``dp_shard`` only), which one
    ``torch.nn.utils.get_total_norm`` cannot mix: each group of one mesh and placement is reduced
    by DTensor (its shards' contributions summed over the ranks that hold them), then combined.
    With ``pp_group`` (pipeline stages hold different parameters) the stages' norms are combined
    over it too.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        norms.append(torch.zeros(()))
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if pp_group is None:
        return norm
    import torch.distributed as dist

    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, group=pp_group)
    return powered ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, pp_group: Any = None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that are DTensors on several meshes (and,
    with ``pp_group``, on several pipeline stages: the norm of the whole model).

    Returns the total norm before clipping (a plain tensor, no host sync).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, float(norm_type), pp_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():  # each rank scales its own shards: the same factor everywhere
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return norm
