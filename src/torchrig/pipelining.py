"""Pipeline parallelism: a model cut into stages at its repeated blocks, run by a torch schedule.

Each stage is the model itself, pruned in place (as torchtitan does, not traced): the blocks of
other stages are removed from their ``nn.ModuleList``/``nn.Sequential`` (the kept ones keep their
keys, ``layers.4`` stays ``layers.4``), and the modules with parameters outside the blocks (the
embedding, the final norm, the head) are replaced on the stages that do not own them by a module
that passes its first argument through. So every parameter keeps its original name: tensor
parallel plans, FSDP wrap policies, state dicts and DCP checkpoints see the names of the unsplit
model, and a checkpoint saved with one split loads into another or into one process.
Tracing (``torch.distributed.pipelining.pipeline``) would rename every parameter and needs a
model ``torch.export`` can capture; pruning needs instead a model whose forward runs its parts in
a chain: ``blocks(embed(x))`` then the head, with no parameterised module that adds a second
input next to the embedding (a learned position table).

The modules that hold parameters outside the blocks go to the first stage when they come before
the first block (in the order the model registers them), else to the stage of the block before
them. Modules without parameters (a rotary-embedding table) stay on every stage.

The model cut into stages gets a class of its own (of the same name) whose ``forward`` is its
stage inside the schedule and, called outside it under ``torch.no_grad()``, the whole model
through a forward-only schedule (:meth:`Pipeline.forward`), so evaluation code runs unchanged.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchrig.speedups import repeated_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Schedule names and the ``torch.distributed.pipelining`` classes they stand for.
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}


def schedule_class(schedule: str | type) -> type:
    """The torch schedule class for a name of :data:`SCHEDULES` or a schedule class itself."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    if isinstance(schedule, type) and issubclass(schedule, _PipelineSchedule):
        return schedule
    if isinstance(schedule, str) and schedule in SCHEDULES:
        return getattr(pipelining, SCHEDULES[schedule])  # type: ignore[no-any-return]
    raise ValueError(
        f"pp_schedule={schedule!r} is not a pipeline schedule; use one of {', '.join(map(repr, SCHEDULES))} "
        "or a schedule class of torch.distributed.pipelining (e.g. ScheduleGPipe)"
    )


def stages_per_rank(cls: type) -> int:
    """1 for schedules of one stage per rank (GPipe, 1F1B), 2 for the multi-stage ones (interleaved, V)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return 1 if issubclass(cls, PipelineScheduleSingle) else 2


def _v_shaped(cls: type) -> bool:
    from torch.distributed import pipelining

    return issubclass(cls, (pipelining.ScheduleZBVZeroBubble, pipelining.ScheduleDualPipeV))


def stage_indices(cls: type, pp_rank: int, pp_size: int) -> list[int]:
    """The stages rank ``pp_rank`` of ``pp_size`` runs: ``[r]``, looped ``[r, r + pp]`` or V ``[r, 2pp - 1 - r]``."""
    per_rank = stages_per_rank(cls)
    if per_rank == 1:
        return [pp_rank]
    if _v_shaped(cls):
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(per_rank)]


def last_stage_rank(cls: type, pp_size: int) -> int:
    """The pipeline rank that holds the last stage (where the loss is computed)."""
    return 0 if stages_per_rank(cls) > 1 and _v_shaped(cls) else pp_size - 1


# -- splitting -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Which stage owns each part of a model: ``blocks[i]`` and ``others[i]`` are module names."""

    num_stages: int
    blocks: tuple[tuple[str, ...], ...]  # per stage, the names of its blocks
    others: tuple[tuple[str, ...], ...]  # per stage, the names of its modules outside the blocks

    def owned(self, stages: Sequence[int]) -> set[str]:
        return {n for s in stages for n in (*self.blocks[s], *self.others[s])}

    def module_names(self, stage: int) -> list[str]:
        """The blocks, then the other modules, of ``stage``."""
        return [*self.blocks[stage], *self.others[stage]]


def split_model(model: nn.Module, num_stages: int, split: Sequence[str] | None = None) -> Split:
    """Assign ``model``'s repeated blocks to ``num_stages`` stages: evenly, or at the block names of ``split``.

    ``split`` names the first module of each stage after the first (``["layers.4", "layers.8"]``
    for 3 stages). Raises ValueError when the model has fewer blocks than stages, when a name of
    ``split`` is not a block, and when a split leaves a stage without blocks.
    """
    kind = type(model).__name__
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in repeated_blocks(model)]
    if len(blocks) < num_stages:
        raise ValueError(
            f"pipeline_parallel: {kind} has {len(blocks)} repeated blocks (two or more children of one class in an "
            f"nn.ModuleList or nn.Sequential) but {num_stages} stages were asked for; each stage needs at least one "
            f"block: use at most {len(blocks)} stages (pipeline_parallel x the schedule's stages per rank)"
        )
    if split is None:
        base, extra = divmod(len(blocks), num_stages)
        starts = [i * base + min(i, extra) for i in range(num_stages)]
    else:
        if isinstance(split, str) or len(split) != num_stages - 1:
            raise ValueError(
                f"pp_split={split!r} must list {num_stages - 1} module names (the first block of each stage after "
                f"the first) for {num_stages} stages"
            )
        starts = [0]
        for name in split:
            if name not in blocks:
                close = ", ".join(blocks[:3] + (["..."] if len(blocks) > 3 else []))
                raise ValueError(
                    f"pp_split names {name!r}, which is not a repeated block of {kind}; name the first block of a "
                    f"stage as model.named_modules() gives it ({close})"
                )
            starts.append(blocks.index(name))
        for stage in range(num_stages):
            end = starts[stage + 1] if stage + 1 < num_stages else len(blocks)
            if end <= starts[stage]:
                raise ValueError(
                    f"pp_split={list(split)!r} leaves stage {stage} without blocks (stage {stage} would start at "
                    f"{blocks[starts[stage]] if starts[stage] < len(blocks) else 'the end'}); list the names in "
                    "the model's order, each stage starting at a later block"
                )
    per_stage = [tuple(blocks[a:b]) for a, b in zip(starts, [*starts[1:], len(blocks)], strict=True)]
    stage_of = {b: s for s, group in enumerate(per_stage) for b in group}
    others: list[list[str]] = [[] for _ in range(num_stages)]
    stage = 0
    skip: tuple[str, ...] = ()
    for name, sub in model.named_modules():
        if name in stage_of:
            stage, skip = stage_of[name], (f"{name}.",)
            continue
        if not name or name.startswith(skip) or not any(True for _ in sub.parameters()):
            continue
        if any(b.startswith(f"{name}.") for b in blocks):  # holds blocks: only its own parameters count
            own = [p for p, _ in sub.named_parameters(recurse=False)]
            if own:
                raise ValueError(
                    f"pipeline_parallel: {kind}.{name} holds parameters {own} next to the blocks it contains; a "
                    "stage can only drop whole modules: move them into a submodule of their own"
                )
            continue
        others[stage].append(name)
        skip = (f"{name}.",)
    own = [p for p, _ in model.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"pipeline_parallel: {kind} holds parameters {own} itself, next to its blocks; a stage can only drop "
            "whole modules: move them into a submodule of their own"
        )
    return Split(num_stages, tuple(per_stage), tuple(tuple(o) for o in others))


class Passthrough(nn.Module):
    """Stands for a module of another stage: returns its first argument (the activation received)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def prune(model: nn.Module, split: Split, stages: Sequence[int], *, in_place: bool) -> nn.Module:
    """``model`` keeping only the parts of ``stages``: blocks of other stages removed (the kept ones keep
    their keys), their other modules replaced by :class:`Passthrough`. ``in_place=False`` returns a
    new module tree sharing every kept submodule with ``model``."""
    keep = split.owned(stages)
    drop_blocks = {b for group in split.blocks for b in group} - keep
    passthrough = {o for group in split.others for o in group} - keep
    ancestors = holders(drop_blocks | passthrough)

    def visit(module: nn.Module, prefix: str) -> nn.Module:
        if not in_place:
            module = copy.copy(module)
            module._modules = type(module._modules)(module._modules)
        for name, child in list(module._modules.items()):
            full = f"{prefix}{name}"
            if full in drop_blocks:
                del module._modules[name]
            elif full in passthrough:
                module._modules[name] = Passthrough()
            elif full in ancestors and child is not None:
                module._modules[name] = visit(child, f"{full}.")
        return module

    return visit(model, "")


def holders(names: set[str]) -> set[str]:
    """The names of the modules that hold the modules ``names`` (the root, ``""``, left out)."""
    return {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}


def stage_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: a stage sends tensors, so a model output object gives its ``logits`` (Hugging
    Face), a tuple its first element. A view (a head's ``hidden[:, -n:]`` passed through) is copied:
    the split-backward schedules (zero bubble) free a stage's output in place, which a view forbids."""
    out = None
    if isinstance(output, torch.Tensor):
        out = output
    elif isinstance(output, Mapping) and "logits" in output:
        out = output["logits"]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        out = output[0]
    if isinstance(out, torch.Tensor):
        return out.clone() if out._is_view() else out
    raise TypeError(
        f"pipeline_parallel: a stage of {type(module).__name__} returned a {type(output).__name__}; a stage must "
        "return a tensor (or an output with .logits, or a tuple whose first element is the activation)"
    )


# -- running ---------------------------------------------------------------------------------------
@dataclass
class Pipeline:
    """The stages one rank runs and the schedule that drives them (what :func:`apply_pp` returns)."""

    model: nn.Module  # this rank's part of the model: every stage it runs, original names
    stage_modules: list[nn.Module]  # one per local stage (``model`` itself when there is one)
    stage_indices: list[int]
    num_stages: int
    split: Split
    schedule_cls: type
    microbatches: int
    group: Any  # the pipeline process group
    last_rank: int  # the pipeline rank of the last stage
    elsewhere: frozenset[str] = frozenset()  # state-dict keys of the whole model that other ranks' stages hold
    _schedule: Any = None
    _loss_fn: Callable[..., torch.Tensor] | None = None
    _forward: dict[Any, Any] = field(default_factory=dict)  # the forward-only schedules, by input shapes
    _losses: list[torch.Tensor] = field(default_factory=list)  # the step's losses, unscaled (last stage)
    _divisor: int = 1  # the step's losses are divided by this too before their backward
    running: bool = False  # inside a schedule's step: the only place a stage's forward may run

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def _build(
        self, microbatches: int, loss_fn: Callable[..., torch.Tensor] | None, device: torch.device, cls: Any = None
    ) -> Any:
        """A schedule (``cls``, default :attr:`schedule_cls`) over new ``PipelineStage`` objects for this
        rank's stages (a stage infers the shapes it sends and receives at its first step, so each
        schedule gets its own)."""
        from torch.distributed.pipelining import PipelineStage

        stages = [
            PipelineStage(module, index, self.num_stages, device, group=self.group)
            for module, index in zip(self.stage_modules, self.stage_indices, strict=True)
        ]
        stage = stages[0] if stages_per_rank(self.schedule_cls) == 1 else stages
        return (cls or self.schedule_cls)(stage, microbatches, loss_fn=loss_fn, scale_grads=False)

    def schedule(self, loss_fn: Callable[..., torch.Tensor], device: torch.device) -> Any:
        """The schedule over this rank's stages with ``loss_fn(output, target)`` (built once per loss function)."""
        if self._schedule is None or self._loss_fn is not loss_fn:
            microbatches = self.microbatches

            def scaled(output: Any, target: Any) -> torch.Tensor:
                loss = loss_fn(output, target)
                self._losses.append(loss.detach())
                return loss / (microbatches * self._divisor)

            # The loss is divided by the microbatches, not the gradients after the step (torch's
            # scale_grads divides every gradient, those of earlier accumulated steps too).
            self._schedule = self._build(microbatches, scaled, device)
            self._loss_fn = loss_fn
        return self._schedule

    def step(
        self,
        loss_fn: Callable[..., torch.Tensor],
        args: tuple[Any, ...],
        target: Any,
        device: torch.device,
        divisor: int = 1,
    ) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; the mean loss over the microbatches,
        on every pipeline rank (broadcast from the last stage). Each microbatch's loss is divided by
        ``divisor`` too before its backward (gradient accumulation); the returned mean is not."""
        import torch.distributed as dist

        schedule = self.schedule(loss_fn, device)
        inputs = args if self.has_first_stage else ()
        self.running, self._divisor = True, divisor
        self._losses.clear()
        counted: list[torch.Tensor] = []
        try:
            schedule.step(*inputs, target=target if self.has_last_stage else None, losses=counted, return_outputs=False)
        finally:
            self.running, self._divisor = False, 1
        # The first step also calls the loss function to infer the gradients' shapes, before the
        # microbatches: the last len(counted) losses are the microbatches'.
        losses, self._losses = self._losses[len(self._losses) - len(counted) :], []
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss

    def _forward_schedule(self, batch: int, device: torch.device) -> Any:
        """A forward-only schedule for batches of ``batch`` samples: in the most microbatches, up to
        ``microbatches``, that divide it and that the schedule takes, else in the fewest above. With one
        stage per rank every schedule runs the forwards in order, so GPipe runs them (1F1B would
        want at least as many microbatches as stages); the multi-stage schedules have their own
        rules (the interleaved one, a multiple of the ranks)."""
        from torch.distributed.pipelining import ScheduleGPipe

        cls = ScheduleGPipe if stages_per_rank(self.schedule_cls) == 1 else self.schedule_cls
        divisors = [n for n in range(1, batch + 1) if batch % n == 0]
        most = self.microbatches
        tried = [n for n in reversed(divisors) if n <= most] + [n for n in divisors if n > most]
        refusals = []
        for count in tried:
            try:
                return self._build(count, None, device, cls)
            except ValueError as err:  # the schedule's own check of the microbatch count
                refusals.append(str(err))
        raise ValueError(
            f"pipeline_parallel: a batch of {batch} samples splits into {', '.join(map(str, divisors))} equal "
            f"microbatches, none of which {cls.__name__} takes ({refusals[-1]}); use an evaluation "
            f"batch size divisible by {self.microbatches} (pp_microbatches)"
        )

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The whole model's output for ``args`` through a forward-only schedule (no gradients), on
        every pipeline rank: merged from the microbatches on the last stage, then broadcast.

        The batch is cut into equal microbatches (:meth:`_forward_schedule`: a smaller last batch
        gets fewer); each batch shape has a schedule of its own."""
        import torch.distributed as dist

        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors:
            raise TypeError(
                f"pipeline_parallel: the model's input must hold a tensor (split into microbatches along its first "
                f"dimension); got {', '.join(type(a).__name__ for a in (*args, *kwargs.values())) or 'nothing'}"
            )
        shapes = tuple(tuple(t.shape) for t in tensors)
        schedule = self._forward.get(shapes)
        if schedule is None:
            schedule = self._forward[shapes] = self._forward_schedule(tensors[0].shape[0], device)
        self.running = True
        try:
            out = schedule.eval(*args, **kwargs) if self.has_first_stage else schedule.eval()
        finally:
            self.running = False
        # the last stage holds the output: its shape and dtype first, so the other ranks can receive it
        meta: list[Any] = [(tuple(out.shape), out.dtype) if self.has_last_stage else None]
        dist.broadcast_object_list(meta, group=self.group, group_src=self.last_rank)
        shape, dtype = meta[0]
        result = out.contiguous() if self.has_last_stage else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(result, group=self.group, group_src=self.last_rank)
        return result


def apply_pp(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    schedule: str | type = "1F1B",
    microbatches: int | None = None,
    split: Sequence[str] | None = None,
) -> Pipeline:
    """Cut ``model`` into pipeline stages over ``pp_mesh`` and keep this rank's (pruned in place).

    ``pp_mesh`` is the 1-D ``"pp"`` mesh; ``schedule`` one of :data:`SCHEDULES` or a torch schedule
    class; ``microbatches`` defaults to twice the stages; ``split`` as in :func:`split_model`.
    Tensor parallel and FSDP go on ``Pipeline.model`` (and each of ``Pipeline.stage_modules`` for
    FSDP's root) afterwards; a strategy finds the pipeline again with :func:`pipeline_of`.
    """
    cls = schedule_class(schedule)
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp_size * stages_per_rank(cls)
    if microbatches is None:
        microbatches = 2 * num_stages
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"pp_microbatches={microbatches!r} must be an int >= 1 (or None: 2 x the stages)")
    layout = split_model(model, num_stages, split)
    local = stage_indices(cls, pp_rank, pp_size)
    every_key = set(model.state_dict(keep_vars=True))
    prune(model, layout, local, in_place=True)
    # one stage: the pruned model itself; several: a module tree per stage, sharing the blocks
    stage_modules = [model] if len(local) == 1 else [prune(model, layout, [s], in_place=False) for s in local]
    pipeline = Pipeline(
        model=model,
        stage_modules=stage_modules,
        stage_indices=local,
        num_stages=num_stages,
        split=layout,
        schedule_cls=cls,
        microbatches=microbatches,
        group=pp_mesh.get_group(),
        last_rank=last_stage_rank(cls, pp_size),
        elsewhere=frozenset(every_key - set(model.state_dict(keep_vars=True))),
    )
    for module in stage_modules:
        module.register_forward_hook(stage_output)
    # A part of a stage called alone would compute this rank's part of the model and return an
    # activation, not the model's output: the modules that lost parts refuse outside the schedule,
    # and the model's own forward runs the schedule (below).
    cut = (layout.owned(range(num_stages)) - layout.owned(local)) | {b for group in layout.blocks for b in group}
    for name in sorted(holders(cut) & {n for n, _ in model.named_modules()}):
        model.get_submodule(name).register_forward_pre_hook(functools.partial(_inside_schedule, pipeline))
    kind = type(model)
    model.__class__ = type(kind.__name__, (kind,), {"forward": _pipelined_forward, "__qualname__": kind.__qualname__})
    model.__dict__[_ATTRIBUTE] = pipeline  # found again by pipeline_of (a plain attribute, not a submodule)
    return pipeline


def _pipelined_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a model cut into stages: inside the schedule the model's own (this rank's
    stage); outside it, under ``torch.no_grad()``, the whole model through a forward-only schedule
    (:meth:`Pipeline.forward`); with gradients on, an error (training goes through ``forward_backward``)."""
    pipeline = pipeline_of(self)
    assert pipeline is not None
    if pipeline.running:
        return _pipelined_class(self).__bases__[0].forward(self, *args, **kwargs)  # type: ignore[attr-defined]
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{type(self).__name__} is cut into pipeline stages (pipeline_parallel): model(x) with gradients "
            f"on would run only stage {', '.join(map(str, pipeline.stage_indices))} of {pipeline.num_stages}. "
            "Train with loss = rig.forward_backward(model, loss_fn, x, target=y) (in a TrainingModule's "
            "training_step: loss = self.forward_loss(loss_fn, x, target=y)), which runs the whole schedule; "
            "under torch.no_grad() model(x) runs a forward-only schedule and returns the output on every rank"
        )
    device = next((p.device for p in self.parameters()), torch.device("cpu"))
    return pipeline.forward(args, kwargs, device)


def _pipelined_class(module: nn.Module) -> type:
    """The class :func:`apply_pp` gave ``module`` (FSDP2 may have subclassed it since)."""
    return next(c for c in type(module).__mro__ if c.__dict__.get("forward") is _pipelined_forward)


def _inside_schedule(pipeline: Pipeline, module: nn.Module, args: Any) -> None:
    """A forward pre-hook on the modules of a model cut into stages that lost parts: they run only
    inside the schedule."""
    if not pipeline.running:
        raise RuntimeError(
            f"{type(module).__name__} is part of a model cut into pipeline stages (pipeline_parallel): called "
            f"alone it would run only stage {', '.join(map(str, pipeline.stage_indices))} of "
            f"{pipeline.num_stages}. Call the model itself: under torch.no_grad() model(x) runs the whole "
            "model through the pipeline; to train, loss = rig.forward_backward(model, loss_fn, x, target=y) "
            "(in a TrainingModule's training_step: loss = self.forward_loss(loss_fn, x, target=y))"
        )


_ATTRIBUTE = "_torchrig_pipeline"


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The :class:`Pipeline` :func:`apply_pp` made of ``model``; None when it was not cut into stages."""
    return model.__dict__.get(_ATTRIBUTE)
