"""The Strategy interface: how processes and model replicas are laid out.

A strategy owns process-group set-up, module wrapping, dataloader sharding and the collectives.
The base class implements everything for one process, so a single-device run pays nothing for
collectives; distributed strategies override what they need.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from torchrig.accelerators.base import Accelerator
    from torchrig.pipelining import Pipeline
    from torchrig.precision import Precision
    from torchrig.wrappers import RigModule

REDUCE_OPS = ("mean", "sum", "max", "min")


class Strategy:
    """The process layout of a run. Subclass it for a new layout and register it by name.

    A strategy lays out one run: :func:`torchrig.resolve.resolve` (which ``Rig`` and ``Trainer``
    call) gives it the run's ``accelerator``, ``parallel_devices``, ``precision`` and
    ``num_nodes`` through :meth:`bind`, once. A strategy instance passed to ``Rig(strategy=...)``
    (or carried by an accelerator) is that Rig's from then on; a second Rig refuses it.
    """

    #: True when checkpoints are written as shards by every rank (torch.distributed.checkpoint).
    sharded: ClassVar[bool] = False
    #: True when ``setup_module`` itself materialises parameters created on ``meta``.
    materializes_meta: ClassVar[bool] = False

    def __init__(self) -> None:
        self.accelerator: Accelerator | None = None
        self.parallel_devices: list[torch.device] = [torch.device("cpu")]
        self.precision: Precision | None = None
        self.num_nodes: int = 1
        self._bound = False

    def bind(
        self, *, accelerator: Accelerator, devices: list[torch.device], precision: Precision, num_nodes: int
    ) -> None:
        """Give the strategy the run it lays out (called by :func:`~torchrig.resolve.resolve`).

        Raises:
            ValueError: the strategy was bound before: it already lays out another Rig's run
                (its devices, process group and launcher), so each Rig needs its own instance.
        """
        if getattr(self, "_bound", False):  # a subclass may skip Strategy.__init__
            raise ValueError(
                f"strategy={self!r} is already used by another Rig or Trainer: a Strategy instance lays out "
                f"one run (its devices, precision and process group). Give each Rig/Trainer its own instance "
                f"({type(self).__name__}(...)), or a strategy name such as 'ddp'"
            )
        self.accelerator = accelerator
        self.parallel_devices = list(devices)
        self.precision = precision
        self.num_nodes = num_nodes
        self._bound = True

    # -- layout ---------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """The device this process computes on."""
        return self.parallel_devices[self.local_rank]

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees (the ranks a dataloader is split over)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """Which of those batches this process takes (tensor-parallel peers share one)."""
        return self.global_rank

    def data_parallel_sources(self) -> list[int]:
        """For each data-parallel rank in order, the first global rank that takes its batches."""
        return list(range(self.world_size))

    # -- life cycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Join the process group (if any) and make ``root_device`` current."""
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)

    @property
    def needs_launch(self) -> bool:
        """True when the processes exist only once ``Rig.launch`` starts them (spawn, fork)."""
        return False

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` in every process of the run; here, just this one."""
        return fn(*args, **kwargs)

    def record_progress(self) -> None:
        """Called after each committed ``rig.save``; parallel strategies count it for restarts."""

    def teardown(self) -> None:
        if self.accelerator is not None:
            self.accelerator.teardown()

    # -- modules, optimizers, data --------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device and wrap it for this layout (DDP, FSDP...)."""
        return module.to(self.root_device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def process_dataloader(self, loader: Any) -> Any:
        """A loader ``Rig.prepare`` could not rebuild with its own sampler; returned as is here."""
        return loader

    def module_init_context(self, empty_init: bool) -> contextlib.AbstractContextManager[Any]:
        """Where ``Rig.init_module`` creates parameters: on the device, or on ``meta``."""
        return torch.device("meta") if empty_init else self.root_device

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation inside the block (gradient accumulation)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type, foreach=None)

    def forward_backward(
        self,
        module: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        args: tuple[Any, ...],
        target: Any,
        divisor: int = 1,
    ) -> torch.Tensor:
        """One step's forward and backward: ``loss_fn(module(*args), target)`` and the backward of it
        divided by ``divisor`` (gradient accumulation) through the precision; returns the loss,
        detached, not divided. A module cut into pipeline stages (:meth:`pipeline`) runs its
        schedule instead, under the precision's autocast."""
        if self.precision is None:
            raise RuntimeError("the strategy has no precision yet; create the Rig first")
        pipeline = self.pipeline(module)
        if pipeline is not None:
            if self.precision.scaler is not None:
                raise ValueError(
                    "precision='16-mixed' scales the loss with a GradScaler, which pipeline schedules do not run; "
                    "use precision='bf16-mixed' with pipeline_parallel"
                )
            with self.precision.autocast():
                return pipeline.step(loss_fn, args, target, self.root_device, divisor)
        loss = loss_fn(module(*args), target)
        self.precision.backward(loss / divisor if divisor != 1 else loss)
        return loss.detach()

    def pipeline(self, module: nn.Module) -> Pipeline | None:
        """The pipeline ``module`` runs through, or None: only ``ModelParallelStrategy(pipeline_parallel=...)``
        cuts a module into stages."""
        return None

    def step_caller(self, module: RigModule, method: Callable[..., Any]) -> Callable[..., Any]:
        """How the Trainer calls ``method`` (``training_step``, ``validation_step``...) once per batch:
        as the wrapped module's forward (:meth:`RigModule.step_caller`). A pipeline runs each
        stage's forward inside its schedule (each stage an FSDP root), so there the step is called
        directly instead."""
        return module.step_caller(method) if self.pipeline(module) is None else module.direct_caller(method)

    def manual_step_caller(self, module: RigModule, method: Callable[..., Any]) -> Callable[..., Any]:
        """How the Trainer calls ``method`` (``training_step``) under manual optimization, where the
        backward passes and optimizer steps happen inside it.

        By default as the wrapped module's forward (the wrapper's hooks, DDP's buffer broadcast,
        see the step as one forward), with the wrapper's own gradient sync off: the end of that
        forward would arm the sync for a backward that never comes; ``manual_backward`` arms each
        one (:meth:`prepare_for_backward`)."""
        step = module.step_caller(method)
        wrapped = module._forward_module

        def call(*args: Any) -> Any:
            with self.no_backward_sync(wrapped, True):
                return step(*args)

        return call

    def prepare_for_backward(self, module: nn.Module, loss: torch.Tensor) -> None:
        """Make the wrapper of ``module`` synchronise the gradients of the backward of ``loss``.

        Manual optimization runs its backward passes inside ``training_step``, which the wrapper
        sees as one forward, run with the wrapper's own sync off (``no_backward_sync``);
        ``manual_backward`` calls this before each backward that synchronises. Nothing by default."""

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict of ``module``, as a checkpoint stores it."""
        return module.state_dict()

    # -- collectives (identity in one process) --------------------------------------------
    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Stack ``tensor`` from every process: shape ``(world_size, *tensor.shape)``."""
        return tensor.unsqueeze(0)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        check_reduce_op(op)
        return tensor

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return [obj]

    def barrier(self, name: str | None = None) -> None:
        return None

    def reduce_boolean_decision(self, flag: bool, all: bool = True) -> bool:
        return bool(flag)

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        yield

    # -- registration ---------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this class under its short name(s); override it to make the class selectable.

        Example:
            >>> import torchrig
            >>> class MyDDP(torchrig.DDPStrategy):
            ...     @classmethod
            ...     def register_strategies(cls, registry):
            ...         registry.register("my_ddp_doc", cls, description="doc example", override=True)
            >>> "my_ddp_doc" in torchrig.STRATEGY_REGISTRY
            True
        """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "register_strategies" in cls.__dict__:
            from torchrig.strategies.registry import STRATEGY_REGISTRY

            cls.register_strategies(STRATEGY_REGISTRY)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce(op={op!r}) is not a reduction; use one of {', '.join(REDUCE_OPS)}")


def reset_parameters(module: nn.Module) -> None:
    """Initialise a module materialised from ``meta`` (``to_empty``) with its own initialisation.

    A submodule with an ``init_weights()`` that takes no arguments (every Hugging Face
    ``PreTrainedModel``; torchtitan's models) initialises its whole subtree with it, buffers
    included (a rotary embedding's ``inv_freq``, recomputed from the config). Every other submodule
    calls its ``reset_parameters()`` (or ``_reset_parameters()``, as ``nn.MultiheadAttention``).
    Parameters and non-persistent buffers that neither reaches hold uninitialised memory: a warning
    names them (loading a checkpoint repairs the parameters, never those buffers, which it does not hold).
    """
    missing: list[str] = []
    buffers: list[str] = []
    covered: set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in covered:
            continue
        init_all = _whole_tree_init(sub)
        if init_all is not None:
            init_all()
            covered.update(id(m) for m in sub.modules())
            continue
        # ``_reset_parameters`` is what nn.MultiheadAttention and nn.Transformer call theirs.
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset):
            reset()
            continue
        label = f"{name or '<root>'} ({type(sub).__name__})"
        if any(True for _ in sub.parameters(recurse=False)):
            missing.append(label)
        buffers += [f"{name}.{b}" if name else b for b in sorted(sub._non_persistent_buffers_set)]
    if missing:
        warnings.warn(
            "rig.init_module(empty_init=True): these modules have parameters but no reset_parameters(), so "
            f"their materialised parameters hold uninitialised memory: {', '.join(missing)}. Add a "
            "reset_parameters() method, or load weights after prepare",
            stacklevel=3,
        )
    if buffers:
        warnings.warn(
            "rig.init_module(empty_init=True): these non-persistent buffers were created on the meta device and "
            f"nothing initialised them, so they hold uninitialised memory: {', '.join(buffers)}. Loading weights "
            "cannot repair them (a checkpoint does not hold them): give their module a reset_parameters() that "
            "computes them (or the model an init_weights()), or create the model without empty_init=True",
            stacklevel=3,
        )


def _whole_tree_init(module: nn.Module) -> Callable[[], Any] | None:
    """``module.init_weights`` when it initialises its subtree and takes no arguments, else None."""
    init = getattr(module, "init_weights", None)
    if not callable(init):
        return None
    try:
        params = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return init
