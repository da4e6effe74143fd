"""``compile=`` and ``activation_checkpointing=``: the two speed switches ``Rig.prepare`` applies.

Both leave the module tree as it is (no wrapper modules, no ``_orig_mod.`` or
``_checkpoint_wrapped_module.`` in parameter names), so state dicts, checkpoints, optimizers and
the strategies see the same module with or without them:

- compilation is installed in place, as ``nn.Module.compile`` does: the module's call goes
  through a ``torch.compile``-d ``_call_impl`` (traced at the first call, after the strategy has
  split and sharded the parameters);
- activation checkpointing replaces a block's ``forward`` (an instance attribute) by one that
  runs the class's ``forward`` under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

A *repeated block* is a child of an ``nn.ModuleList`` or ``nn.Sequential`` whose children (at
least two) are all of one class: a transformer's layers. Blocks inside a block are not counted
again. See docs/speed.md.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchrig import arguments

__all__ = [
    "ActivationCheckpointing",
    "Compile",
    "apply",
    "checkpointed_blocks",
    "repeated_blocks",
    "resolve_activation_checkpointing",
    "resolve_compile",
    "unwrap_compiled",
]


# -- arguments -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Compile:
    """What ``compile=`` asks for: ``regional`` (each repeated block) or the whole model, with
    ``torch.compile`` keyword arguments."""

    regional: bool
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ActivationCheckpointing:
    """What ``activation_checkpointing=`` asks for: the instances of ``classes``, or every
    ``every``-th repeated block (1: all of them)."""

    classes: tuple[type[nn.Module], ...] = ()
    every: int = 1


def _compile_parameters() -> list[str]:
    return [p for p in inspect.signature(torch.compile).parameters if p != "model"]


def resolve_compile(value: Any) -> Compile | None:
    """``compile=``: None/False (off), True (whole model), ``"regional"``, or a dict of
    ``torch.compile`` keyword arguments (``"regional": True`` allowed in it)."""
    if value is None or value is False:
        return None
    if value is True:
        return Compile(regional=False)
    if value == "regional":
        return Compile(regional=True)
    if isinstance(value, dict):
        kwargs = dict(value)
        regional = kwargs.pop("regional", False)
        if not isinstance(regional, bool):
            raise ValueError(f"compile={value!r}: 'regional' must be True or False, got {regional!r}")
        known = _compile_parameters()
        unknown = sorted(str(k) for k in kwargs if k not in known)
        if unknown:
            raise ValueError(
                f"compile={value!r}: {', '.join(repr(k) for k in unknown)} is not an argument of torch.compile "
                f"(it takes {', '.join(known)}, and 'regional')"
            )
        return Compile(regional=regional, kwargs=kwargs)
    raise ValueError(
        f"compile={value!r}; use None (off), True (the whole model), 'regional' (each repeated block) "
        "or a dict of torch.compile arguments"
    )


def _is_block_class(x: Any) -> bool:
    return isinstance(x, type) and issubclass(x, nn.Module)


def resolve_activation_checkpointing(value: Any) -> ActivationCheckpointing | None:
    """``activation_checkpointing=``: None, a set of block classes, ``"full"`` (every repeated
    block), ``"selective"`` (every second one), or ``("selective", n)`` (every n-th)."""
    if value is None:
        return None
    if value == "full":
        return ActivationCheckpointing(every=1)
    if value == "selective":
        return ActivationCheckpointing(every=2)
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == "selective":
        name, hint = f"activation_checkpointing={value!r}: n", " (every n-th repeated block is checkpointed)"
        return ActivationCheckpointing(every=arguments.int_in_range(name, value[1], 1, hint=hint))
    if isinstance(value, (set, frozenset, tuple, list)) and value and all(_is_block_class(c) for c in value):
        return ActivationCheckpointing(classes=tuple(value))
    raise ValueError(
        f"activation_checkpointing={value!r}; use None, a set of nn.Module classes ({{Block}}), "
        "'full' (every repeated block), 'selective' (every second one) or ('selective', n) (every n-th)"
    )


# -- finding blocks ------------------------------------------------------------------------
def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``, in order: the children of each ``nn.ModuleList`` or
    ``nn.Sequential`` whose children (two or more) are all of one class; none inside another."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            children = list(sub.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                found.extend(children)
                inside.update(id(m) for c in children for m in c.modules())
    return found


def checkpointed_blocks(module: nn.Module, ac: ActivationCheckpointing) -> list[nn.Module]:
    """The submodules ``ac`` checkpoints in ``module`` (outermost ones only, never ``module``)."""
    if ac.classes:
        picked: list[nn.Module] = []
        inside: set[int] = set()
        for sub in module.modules():
            if id(sub) in inside or not isinstance(sub, ac.classes):
                continue
            if sub is module:
                raise ValueError(
                    f"activation_checkpointing: {type(module).__name__} is the model given to prepare(); "
                    "name the classes of its blocks, which are recomputed in backward"
                )
            picked.append(sub)
            inside.update(id(m) for m in sub.modules())
        if not picked:
            names = ", ".join(sorted(c.__name__ for c in ac.classes))
            raise ValueError(f"activation_checkpointing: {type(module).__name__} has no submodule of class {names}")
        return picked
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(_no_blocks("activation_checkpointing", module))
    return blocks[:: ac.every]


def _no_blocks(argument: str, module: nn.Module) -> str:
    return (
        f"{argument}: {type(module).__name__} has no repeated blocks (two or more children of one class in an "
        "nn.ModuleList or nn.Sequential)"
        + ("; use compile=True" if argument == "compile" else "; pass the block classes, {Block}")
    )


# -- applying ------------------------------------------------------------------------------
class _Checkpointed:
    """A block's ``forward`` run under non-reentrant activation checkpointing (the class's
    ``forward``, recomputed in backward instead of keeping its activations)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        return checkpoint(forward, self.module, *args, use_reentrant=False, **kwargs)


class _CompiledCall:
    """A module's ``_compiled_call_impl`` (what ``nn.Module.compile`` sets): ``_call_impl``
    compiled by ``compiler`` at the first call. A call while the Trainer runs a step as the
    forward (an instance ``forward`` then stands in for it) stays eager: only the model's own
    forward is compiled. (``nn.Module`` leaves it out of copies and pickles: a copy is uncompiled.)"""

    def __init__(self, module: nn.Module, compiler: Callable[[Any], Any]) -> None:
        self.module = module
        self.compiler = compiler
        self.compiled: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if "forward" in module.__dict__ and not isinstance(module.__dict__["forward"], _Checkpointed):
            return module._call_impl(*args, **kwargs)
        if self.compiled is None:
            self.compiled = self.compiler(module._call_impl)
        return self.compiled(*args, **kwargs)


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, Callable[[Any], Any] | None]:
    """``module`` without the ``OptimizedModule`` of a ``torch.compile(module)`` done before
    ``prepare`` (whose state-dict keys start with ``_orig_mod.``), and that compilation's settings."""
    compiler = None
    if "torch._dynamo" not in sys.modules:  # nothing was compiled (and importing dynamo takes a while)
        return module, compiler
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(module, OptimizedModule):
        compiler = module.dynamo_ctx
        module = module._orig_mod
    return module, compiler


def apply(
    module: nn.Module,
    compile: Compile | None,
    activation_checkpointing: ActivationCheckpointing | None,
    compiler: Callable[[Any], Any] | None = None,
) -> None:
    """Checkpoint, then compile, ``module``'s blocks (or the whole of it), in place.

    ``compiler`` is the settings of a compilation done before ``prepare`` (the whole model)."""
    if activation_checkpointing is not None:
        for block in checkpointed_blocks(module, activation_checkpointing):
            block.forward = _Checkpointed(block)  # type: ignore[method-assign]
    if compile is not None:
        compiler = functools.partial(torch.compile, **compile.kwargs)
    if compiler is None:
        return
    targets: Iterable[nn.Module] = [module]
    if compile is not None and compile.regional:
        targets = repeated_blocks(module)
        if not targets:
            raise ValueError(_no_blocks("compile", module))
    for target in targets:
        target._compiled_call_impl = _CompiledCall(target, compiler)
