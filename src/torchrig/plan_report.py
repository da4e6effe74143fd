"""What a :func:`torchrig.plan` found: each rank's parameter shards and bytes, the whole job's plan,
and the plan as text (``torchrig plan``) or a dict (``--json``).

:func:`~torchrig.planner.plan` fills these records; this module only holds and shows them (no
torch, no process group).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ShardInfo:
    """One parameter on one rank: its full shape, the shape this rank holds, and how it is split."""

    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str
    dtype: str

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds: its parameters' shards and the bytes they take."""

    rank: int
    coordinates: dict[str, int]
    params: list[ShardInfo]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: With pipeline parallel: the stages this rank runs, their modules, and how many microbatches'
    #: activations the schedule keeps in flight on it at most.
    stages: tuple[int, ...] = ()
    stage_modules: tuple[str, ...] = ()
    in_flight: int = 0

    def layout(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """What distinguishes this rank's layout from another's (not which rank it is)."""
        return tuple((p.name, p.local_shape, p.placements) for p in self.params)


@dataclass
class ParallelPlan:
    """The plan of a whole job: the mesh and every rank's :class:`RankPlan` (see :func:`plan`)."""

    world_size: int
    mesh_sizes: dict[str, int]
    precision: str
    numel: int
    ranks: list[RankPlan] = field(default_factory=list)
    seconds: float = 0.0
    #: The output shape of the forward/backward run on fake tensors, per applied rank (with ``step_input``).
    step_outputs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: With pipeline parallel: the schedule's name, its microbatches and its bubble fraction.
    schedule: str | None = None
    microbatches: int = 0
    bubble: float | None = None

    def groups(self) -> list[tuple[list[int], RankPlan]]:
        """Ranks with the same layout, together (most jobs have one or a few)."""
        out: dict[Any, tuple[list[int], RankPlan]] = {}
        for r in self.ranks:
            out.setdefault(r.layout(), ([], r))[0].append(r.rank)
        return list(out.values())

    def report(self, *, max_params: int | None = 40) -> str:
        """The plan as text: the mesh, each distinct layout's shards, and the memory of every rank."""
        sizes = " x ".join(f"{k}={v}" for k, v in self.mesh_sizes.items())
        lines = [
            f"{self.world_size} ranks, mesh {sizes}, precision {self.precision}, "
            f"{self.numel:,} parameters (planned in {self.seconds:.1f} s)",
        ]
        if self.schedule is not None and self.bubble is not None:
            lines.append(
                f"pipeline schedule {self.schedule}, {self.microbatches} microbatches, "
                f"bubble {100 * self.bubble:.1f}% of a step"
            )
        for rank, shape in self.step_outputs.items():
            lines.append(f"forward + backward as rank {rank} on fake tensors: output {_shape(shape)}")
        for ranks, r in self.groups():
            lines.append("")
            if r.stages:
                lines.append(
                    f"ranks {_ranges(ranks)}: stage {', '.join(map(str, r.stages))} "
                    f"({', '.join(_module_ranges(r.stage_modules))}), activations of up to {r.in_flight} "
                    "microbatches in flight"
                )
            lines.append(f"ranks {_ranges(ranks)}: parameter shards (name, full shape -> local shape, placements)")
            shown = r.params if max_params is None else r.params[:max_params]
            width = max((len(p.name) for p in shown), default=0)
            for p in shown:
                lines.append(f"  {p.name:<{width}}  {_shape(p.shape)} -> {_shape(p.local_shape)}  {p.placements}")
            if len(shown) < len(r.params):
                lines.append(f"  ... {len(r.params) - len(shown)} more (--all-params shows them)")
        lines.append("")
        lines.append("memory per rank (params + grads + AdamW state; activations and gathered layers not counted)")
        by_memory: dict[tuple[int, int, int], list[int]] = {}
        for r in self.ranks:
            by_memory.setdefault((r.param_bytes, r.grad_bytes, r.optimizer_bytes), []).append(r.rank)
        lines.append(f"  {'ranks':<16} {'params':>10} {'grads':>10} {'AdamW':>10} {'total':>10}")
        for (pb, gb, ob), ranks in by_memory.items():
            lines.append(
                f"  {_ranges(ranks):<16} {_gib(pb):>10} {_gib(gb):>10} {_gib(ob):>10} {_gib(pb + gb + ob):>10}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "mesh_sizes": self.mesh_sizes,
            "precision": self.precision,
            "numel": self.numel,
            "seconds": self.seconds,
            "step_outputs": {str(k): v for k, v in self.step_outputs.items()},
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "bubble": self.bubble,
            "ranks": [
                {
                    "rank": r.rank,
                    "coordinates": r.coordinates,
                    "stages": list(r.stages),
                    "stage_modules": list(r.stage_modules),
                    "in_flight": r.in_flight,
                    "param_bytes": r.param_bytes,
                    "grad_bytes": r.grad_bytes,
                    "optimizer_bytes": r.optimizer_bytes,
                    "params": [
                        {"name": p.name, "shape": p.shape, "local_shape": p.local_shape, "placements": p.placements}
                        for p in r.params
                    ],
                }
                for r in self.ranks
            ],
        }


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _module_ranges(names: Iterable[str]) -> list[str]:
    """``layers.0, layers.1, layers.2, norm`` -> ``layers.0-2, norm``."""
    out: list[str] = []
    run: list[str] = []
    for name in [*names, ""]:
        head, _, index = name.rpartition(".")
        if run and index.isdigit() and run[-1].rpartition(".")[0] == head:
            run.append(name)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1].rpartition('.')[2]}")
        run = [name] if index.isdigit() else []
        if name and not index.isdigit():
            out.append(name)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None], strict=True):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b  # type: ignore[assignment]
    return ",".join(out)
