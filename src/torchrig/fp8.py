"""``precision="fp8-mixed"``: bf16-mixed with chosen ``nn.Linear`` layers computed in float8.

The layers are converted by torchao's float8 training (``torchao.float8.convert_to_float8_training``):
each chosen ``nn.Linear`` becomes a ``torchao.float8.Float8Linear`` that casts its input, weight and
output gradient to float8 with dynamic scales and multiplies them with ``torch._scaled_mm``. The
weights stay fp32 parameters with the same names (checkpoints are those of bf16-mixed); everything
else runs under bf16 autocast, as with ``bf16-mixed``.

torchao is an optional extra: ``pip install 'torchrig[fp8]'``. Which layers are converted:

- by default every ``nn.Linear`` but the first and the last in module order (torchao's advice: the
  layers nearest the input and the output keep high precision), and only those whose
  ``in_features`` and ``out_features`` are both multiples of 16 (``torch._scaled_mm`` needs that);
- with :class:`FP8Mixed` ``(module_filter_fn=...)``, the ``nn.Linear`` layers the function picks
  (``fn(module, fully_qualified_name) -> bool``, torchao's signature); a picked layer whose sizes
  are not multiples of 16 is an error.

A run that would convert no layer at all is an error too: it would be bf16-mixed under another name.
See docs/speed.md.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from torchrig.devices import device_module

__all__ = ["FP8_PRECISION", "FP8Mixed", "convert", "fp8_unsupported_reason", "require_torchao"]

#: The name of the precision.
FP8_PRECISION = "fp8-mixed"
#: ``torch._scaled_mm`` multiplies float8 matrices whose inner and outer sizes are multiples of this.
MULTIPLE = 16
#: The CUDA compute capability float8 matmul needs (Ada Lovelace; Hopper is 9.0).
MIN_CUDA_CAPABILITY = (8, 9)

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class FP8Mixed:
    """``precision="fp8-mixed"`` with a choice of layers or a torchao configuration.

    Args:
        module_filter_fn: ``fn(module, fqn) -> bool``, called for every ``nn.Linear`` of the model
            (``fqn`` is its name in ``model.named_modules()``); the layers it returns True for are
            converted. None: every ``nn.Linear`` but the first and the last, of sizes that are
            multiples of 16.
        config: a ``torchao.float8.Float8LinearConfig`` (e.g.
            ``Float8LinearConfig.from_recipe_name("rowwise")``); None: torchao's default
            (tensorwise dynamic scaling).

    Example:
        >>> import torchrig
        >>> precision = torchrig.FP8Mixed(module_filter_fn=lambda module, fqn: fqn.startswith("blocks."))
        >>> rig = torchrig.Rig(precision=precision)  # doctest: +SKIP
    """

    module_filter_fn: ModuleFilter | None = None
    config: Any = None

    def __post_init__(self) -> None:
        if self.module_filter_fn is not None and not callable(self.module_filter_fn):
            raise TypeError(
                f"FP8Mixed(module_filter_fn={self.module_filter_fn!r}) must be a function (module, fqn) -> bool, "
                "or None for the default (every nn.Linear but the first and the last)"
            )


class _ExpectedImportNoise(logging.Filter):
    """What importing torchao logs that says nothing about this run: the kernels built for another
    torch or device that this torch build cannot load (``Failed to load .../torchao/_C_mxfp8...``),
    and torch's deprecation of the Enum registration torchao still makes. Anything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        own_kernel = text.startswith("Failed to load ") and f"torchao{os.sep}_C" in text
        return not (own_kernel or "is an Enum subclass and is now natively supported" in text)


#: The loggers of those messages: torchao's import, and torch's pytree registry it calls.
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def require_torchao() -> ModuleType:
    """``torchao.float8``, or an error saying how to install torchao."""
    loggers, quiet = [logging.getLogger(name) for name in _NOISY_LOGGERS], _ExpectedImportNoise()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as err:
        raise ModuleNotFoundError(
            f"precision='{FP8_PRECISION}' needs torchao's float8 training (torchao.float8), which cannot be "
            f"imported ({err}); install it with `pip install 'torchrig[fp8]'` (in a clone of torchrig: "
            "`pip install -e '.[fp8]'`), or use precision='bf16-mixed'",
            name="torchao",
        ) from err
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _probe_scaled_mm(device: torch.device) -> str | None:
    """None when ``torch._scaled_mm`` multiplies two float8 matrices on ``device``, else why not."""
    errors = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):  # fnuz: AMD MI300's float8
        try:
            a = torch.zeros(MULTIPLE, MULTIPLE, device=device).to(dtype)
            b = torch.zeros(MULTIPLE, MULTIPLE, device=device).to(dtype).t()
            one = torch.ones((), device=device)
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            return None
        except Exception as err:  # any failure means: no float8 matmul here
            errors.append(f"{dtype}: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}")
    return f"torch._scaled_mm does not run on {device} ({'; '.join(errors)})"


def fp8_unsupported_reason(device_type: str) -> str | None:
    """Why ``device_type`` cannot compute in float8 (None when it can): a CUDA device below compute
    capability 8.9, or a device on which ``torch._scaled_mm`` fails (probed)."""
    if device_type == "cuda" and torch.version.hip is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CUDA_CAPABILITY:
            name = torch.cuda.get_device_name()
            return (
                f"{name} has CUDA compute capability {capability[0]}.{capability[1]}; float8 matmul needs "
                f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} or newer (Ada Lovelace, Hopper, Blackwell)"
            )
    current = getattr(device_module(device_type), "current_device", None)
    try:
        device = torch.device(device_type, current()) if callable(current) else torch.device(device_type)
    except Exception:  # a backend that cannot say its current device: probe its default one
        device = torch.device(device_type)
    return _probe_scaled_mm(device)


def _is_linear(module: nn.Module) -> bool:
    # MultiheadAttention's out_proj: attention reads its weight directly, its forward never runs.
    return isinstance(module, nn.Linear) and not isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)


def _fits(module: nn.Linear) -> bool:
    return module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0


def _sizes(module: nn.Linear) -> str:
    return f"{type(module).__name__}({module.in_features}, {module.out_features})"


def convert(module: nn.Module, spec: FP8Mixed) -> nn.Module:
    """Swap the chosen ``nn.Linear`` layers of ``module`` for torchao ``Float8Linear`` (in place;
    the parameters stay the same objects). Returns ``module`` (a new one only when ``module``
    itself is a chosen ``nn.Linear``)."""
    float8 = require_torchao()
    linears = [(name, m) for name, m in module.named_modules() if _is_linear(m)]
    if spec.module_filter_fn is None:
        ends = {linears[0][0], linears[-1][0]} if linears else set()
        chosen = {name for name, m in linears if name not in ends and _fits(m)}  # type: ignore[arg-type]
    else:
        chosen = {name for name, m in linears if spec.module_filter_fn(m, name)}
        bad = [f"{name or '<root>'}: {_sizes(m)}" for name, m in linears if name in chosen and not _fits(m)]  # type: ignore[arg-type]
        if bad:
            raise ValueError(
                f"precision='{FP8_PRECISION}': module_filter_fn chose {', '.join(bad)}; float8 matmul "
                f"(torch._scaled_mm) needs in_features and out_features that are multiples of {MULTIPLE}. "
                "Leave these layers out of module_filter_fn (they then compute in bf16)"
            )
    if not chosen:
        raise ValueError(_nothing_chosen(module, linears, spec))
    return float8.convert_to_float8_training(  # type: ignore[no-any-return]
        module, module_filter_fn=lambda m, fqn: fqn in chosen and _is_linear(m), config=spec.config
    )


def _nothing_chosen(module: nn.Module, linears: list[tuple[str, nn.Module]], spec: FP8Mixed) -> str:
    head = f"precision='{FP8_PRECISION}' converts no layer of {type(module).__name__} to float8"
    tail = "; use precision='bf16-mixed' for this model"
    if not linears:
        return f"{head}: it has no nn.Linear{tail}"
    if spec.module_filter_fn is not None:
        return f"{head}: module_filter_fn returned False for all its nn.Linear layers{tail}"
    listed = ", ".join(f"{name or '<root>'}: {_sizes(m)}" for name, m in linears)  # type: ignore[arg-type]
    return (
        f"{head}: by default the first and the last nn.Linear stay in bf16, and only layers whose in_features "
        f"and out_features are multiples of {MULTIPLE} are converted (float8 matmul needs that); its nn.Linear "
        f"layers are {listed}. Choose layers with torchrig.FP8Mixed(module_filter_fn=...){tail}"
    )
