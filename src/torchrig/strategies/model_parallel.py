"""``ModelParallelStrategy``: FSDP2, HSDP and tensor parallelism on one named ``DeviceMesh``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchrig import parallel
from torchrig.strategies.fsdp import FSDPStrategy, WrapPolicy
from torchrig.strategies.parallel import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Parallelize = Callable[[nn.Module, "DeviceMesh"], nn.Module]


class ModelParallelStrategy(FSDPStrategy):
    """N-D parallelism: HSDP replicas x FSDP2 shards x tensor parallel, on one ``DeviceMesh``.

    The mesh (:attr:`device_mesh`) has the named dimensions ``"dp_replicate"``, ``"dp_shard"``
    and ``"tp"`` (all present, size 1 where unused), innermost ``tp``: the ranks of one
    tensor-parallel group are neighbours (one machine, when ``tensor_parallel`` divides the
    devices per machine). Dataloaders are split over the data-parallel ranks only: the
    tensor-parallel ranks of one replica see the same batch.

    Without ``parallelize``, ``prepare`` splits the modules ``tp_plan`` (or the ``_tp_plan`` of the
    model and its submodules, :func:`torchrig.parallel.collect_tp_plan`) names over ``mesh["tp"]``
    (:func:`torchrig.parallel.apply_tp`), then shards the model with FSDP2 over the data-parallel
    dimensions (:func:`torchrig.parallel.apply_fsdp`; HSDP when ``data_parallel_replicate > 1``;
    skipped when there is one data-parallel rank).
    With ``parallelize``, ``parallelize(model, mesh)`` does all of it and returns the model.

    Args:
        parallelize: ``fn(model, mesh) -> model``; optional.
        data_parallel_replicate: HSDP replicas (typically one per node or group of nodes).
        data_parallel_shard: FSDP2 shards; ``"auto"``: what the other sizes leave of the world.
        tensor_parallel: ranks each tensor-parallel module is split over.
        tp_plan: ``{"module.name.pattern": style}``; styles ``"colwise"``, ``"rowwise"``,
            ``"colwise_rep"``, ``"colwise_seq"``, ``"rowwise_seq"``, ``"sequence"`` or a
            ``ParallelStyle``. ``*`` matches one part of a module name (``"layers.*.mlp.up"``).
        auto_wrap_policy: layer classes (``{Block}``) or ``module -> bool``: the FSDP2 units.
        reshard_after_forward, mixed_precision: as for :class:`~torchrig.FSDPStrategy`.
        process_group_backend, timeout, start_method: as for :class:`~torchrig.DDPStrategy`.

    Example:
        >>> strategy = ModelParallelStrategy(tensor_parallel=2, tp_plan={"mlp.up": "colwise", "mlp.down": "rowwise"})
        >>> strategy.mesh_sizes(8)
        (1, 4, 2)
    """

    name = "model_parallel"

    def __init__(
        self,
        *,
        parallelize: Parallelize | None = None,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int | str = "auto",
        tensor_parallel: int = 1,
        tp_plan: Mapping[str, Any] | None = None,
        auto_wrap_policy: set[type[nn.Module]] | Iterable[type[nn.Module]] | WrapPolicy | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            auto_wrap_policy=auto_wrap_policy,
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        parallel.check_sizes(data_parallel_replicate, data_parallel_shard, tensor_parallel)
        if parallelize is not None and not callable(parallelize):
            raise TypeError(f"parallelize={parallelize!r} must be a function (model, mesh) -> model")
        if parallelize is not None and tp_plan is not None:
            raise ValueError("pass parallelize= or tp_plan=, not both: parallelize(model, mesh) applies its own plan")
        if tp_plan is not None and (not isinstance(tp_plan, Mapping) or not tp_plan):
            raise TypeError(f"tp_plan={tp_plan!r} must be a non-empty dict of module name pattern -> style")
        self.parallelize = parallelize
        self.data_parallel_replicate = data_parallel_replicate
        self.data_parallel_shard = data_parallel_shard
        self.tensor_parallel = tensor_parallel
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None
        self._mesh: DeviceMesh | None = None

    # -- layout ---------------------------------------------------------------------------
    def mesh_sizes(self, world_size: int | None = None) -> tuple[int, int, int]:
        """``(dp_replicate, dp_shard, tp)`` for ``world_size`` (default: this run's); ValueError if they do not fit."""
        return parallel.mesh_sizes(
            self.world_size if world_size is None else world_size,
            data_parallel_replicate=self.data_parallel_replicate,
            data_parallel_shard=self.data_parallel_shard,
            tensor_parallel=self.tensor_parallel,
        )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(dp_replicate, dp_shard, tp)`` mesh (built when the process group is joined)."""
        if self._mesh is None:
            raise RuntimeError("the device mesh is built when the Rig joins the process group; create the Rig first")
        return self._mesh

    @property
    def data_parallel_size(self) -> int:
        replicate, shard, _ = self.mesh_sizes()
        return replicate * shard

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.mesh_sizes()[2]  # tp is the innermost mesh dimension

    # -- life cycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        sizes = self.mesh_sizes()  # bad sizes fail here, before any process starts
        super().setup_environment()
        self._mesh = parallel.init_mesh(self.root_device.type, sizes)

    def _parallelize(self, module: nn.Module) -> nn.Module:
        mesh = self.device_mesh
        if self.parallelize is not None:
            out = self.parallelize(module, mesh)
            if not isinstance(out, nn.Module):
                raise TypeError(
                    f"parallelize(model, mesh) returned a {type(out).__name__}; it must return the parallelized model"
                )
            return out
        plan = self.tp_plan if self.tp_plan is not None else parallel.collect_tp_plan(module)
        if plan:
            parallel.apply_tp(module, mesh["tp"], plan)
        elif self.tensor_parallel > 1:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} needs a plan saying how to split "
                f"{type(module).__name__}: pass tp_plan={{'module.name': 'colwise' | 'rowwise' | ...}}, give the "
                "model a _tp_plan attribute, or pass parallelize=fn(model, mesh)"
            )
        if parallel.data_parallel_size(mesh) > 1:
            parallel.apply_fsdp(
                module,
                parallel.data_parallel_mesh(mesh),
                wrap_policy=self.auto_wrap_policy,
                mp_policy=self._mixed_precision_policy(),
                reshard_after_forward=self.reshard_after_forward,
            )
        return module

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return parallel.clip_grad_norm_(parameters, max_norm, norm_type)

    def __repr__(self) -> str:
        return (
            f"ModelParallelStrategy(data_parallel_replicate={self.data_parallel_replicate}, "
            f"data_parallel_shard={self.data_parallel_shard!r}, tensor_parallel={self.tensor_parallel})"
        )
