"""Precision: module conversion, the autocast context, and the GradScaler for fp16-mixed.

One small class serves every device type through ``torch.amp.autocast(device_type)`` and
``torch.amp.GradScaler(device_type)``. A precision the device cannot do is an error that lists
what it can do: torchrig never falls back to fp32 behind your back.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from torchrig import arguments
from torchrig.devices import device_module
from torchrig.fp8 import FP8_PRECISION, FP8Mixed, convert, fp8_unsupported_reason, require_torchao
from torchrig.nested import apply_to_tensors

PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}

_TRUE_DTYPES = {
    "32-true": torch.float32,
    "64-true": torch.float64,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}
_MIXED_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, FP8_PRECISION: torch.bfloat16}
#: Every name ``precision=`` takes: :data:`PRECISIONS` and ``fp8-mixed`` (torchao's float8, an optional extra).
NAMES = (*PRECISIONS, FP8_PRECISION)
_HALF = (torch.float16, torch.bfloat16)


def normalize_precision(precision: Any) -> str:
    """Map ``32``, ``"16"``, ``"bf16"``... to the canonical names (an :class:`~torchrig.FP8Mixed` to
    ``"fp8-mixed"``); anything else is an error."""
    if isinstance(precision, FP8Mixed):
        return FP8_PRECISION
    if isinstance(precision, bool) or not isinstance(precision, (int, str)):
        raise TypeError(
            f"precision={precision!r} must be a string such as 'bf16-mixed' (or a torchrig.FP8Mixed); "
            f"choose from {', '.join(NAMES)}"
        )
    name = ALIASES.get(str(precision), str(precision))
    if name not in NAMES and name != "auto":
        hint = _suggestion(name)
        extra = f" Did you mean {hint!r}?" if hint else ""
        raise ValueError(f"unknown precision={precision!r}; choose from {', '.join(NAMES)} or 'auto'.{extra}")
    return name


def _suggestion(name: str) -> str | None:
    """The name an unknown precision most likely means, always a canonical one: dtype spellings of
    other tools read as torchrig's (``fp16``/``float16`` -> ``16-mixed``, ``bfloat16`` ->
    ``bf16-mixed``, ``fp32`` -> ``32-true``), else the closest name."""
    import difflib

    bare = name.strip().lower().replace("bfloat", "bf").replace("float", "").replace("fp", "")
    bare = ALIASES.get(bare, bare)
    if bare in NAMES:
        return bare
    close = difflib.get_close_matches(name, NAMES + tuple(ALIASES), n=1)
    return ALIASES.get(close[0], close[0]) if close else None


def _probe_dtype(device_type: str, dtype: torch.dtype) -> bool:
    if device_type == "cpu":
        return True
    mod = device_module(device_type)
    if dtype is torch.bfloat16 and mod is not None and hasattr(mod, "is_bf16_supported"):
        try:
            return bool(mod.is_bf16_supported())
        except Exception:
            return False
    try:
        torch.ones(1, dtype=dtype, device=device_type)
        return True
    except Exception:
        return False


def supported_precisions(device_type: str) -> list[str]:
    """The precisions ``device_type`` can run, probed on the device itself."""
    out = ["32-true"]
    if device_type not in ("mps", "xla"):
        out.append("64-true")
    autocast = torch.amp.autocast_mode.is_autocast_available(device_type)
    for half in ("16", "bf16"):
        dtype = torch.float16 if half == "16" else torch.bfloat16
        if not _probe_dtype(device_type, dtype):
            continue
        if autocast:
            out.append(f"{half}-mixed")
        out.append(f"{half}-true")
    return out


class DeferredUpdateGradScaler(torch.amp.GradScaler):
    """A GradScaler whose ``update()`` runs once per iteration, however many optimizers step.

    PyTorch's recipe with several optimizers is to step each of them, then call ``update()`` once.
    Prepared optimizers step one at a time, each through :meth:`step`, so the scaler keeps the
    round: the optimizers that stepped since the last update. The round is complete when every
    optimizer :meth:`track`-ed (every one a Rig prepared) has stepped; the update then runs
    before the scale is next used, in :meth:`scale` (the next iteration's first ``backward``), or
    when the scale or the state is read (:meth:`get_scale`, :meth:`state_dict`,
    :meth:`load_state_dict`, pickling, which also end a round still open). So a GAN's D-step
    (backward, step) then G-step (backward, step) updates once per iteration, as PyTorch's
    recipe does. An optimizer that steps again before the round is complete (a critic stepping
    several times per generator step, or an optimizer that never steps) ends the round at that
    second step: its gradients are unscaled with the scale they were scaled with, then the update
    runs. ``unscale_`` and ``step`` never run the update otherwise: they belong to the iteration
    whose losses were scaled with the current scale. With no tracked optimizer, every step
    completes the round (one optimizer: exactly ``step(); update()``).
    """

    _update_due = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tracked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._stepped: set[int] = set()  # ids of the optimizers that stepped since the last update

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer`` among those whose steps make one iteration (``Rig.prepare`` calls it)."""
        self._tracked.add(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if id(optimizer) in self._stepped:
            self._end_round_before(optimizer)
        out = super().step(optimizer, *args, **kwargs)
        self._stepped.add(id(optimizer))
        if all(id(o) in self._stepped for o in self._tracked):
            self._update_due = True
        return out

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._stepped:
            self._end_round_before(optimizer)  # unscales it too
        else:
            super().unscale_(optimizer)

    def _end_round_before(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` steps a second time in this round: unscale its new gradients with the
        current scale (the one they were scaled with), then update with the round's inf checks."""
        states = self._per_optimizer_states
        earlier = states.pop(id(optimizer))
        super().unscale_(optimizer)
        now = states.pop(id(optimizer))
        states[id(optimizer)] = earlier
        self.update()
        self._per_optimizer_states[id(optimizer)] = now

    def apply_deferred_update(self) -> None:
        """Run the update of a complete round now, if there is one (sync-free, like ``update()``)."""
        if self._update_due:
            self.update()

    def _end_iteration(self) -> None:
        """Close the round, complete or not (the iteration is over: the state is saved or replaced)."""
        if self._stepped:
            self.update()

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        # A due update is this call: an explicit update() after a step must not run twice.
        self._update_due = False
        self._stepped = set()
        super().update(new_scale)

    def scale(self, outputs: Any) -> Any:
        self.apply_deferred_update()
        return super().scale(outputs)

    def get_scale(self) -> float:
        self.apply_deferred_update()
        return super().get_scale()

    def state_dict(self) -> dict[str, Any]:
        self._end_iteration()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Finish the iteration first, so the update it owes cannot be applied to the loaded scale.
        self._end_iteration()
        super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        self._end_iteration()
        state = super().__getstate__()
        state.pop("_tracked", None)  # the optimizers are not part of the scaler's state
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._tracked = weakref.WeakSet()
        self._stepped = set()


#: What ``grad_scaler=`` may set: the arguments of ``torch.amp.GradScaler``.
SCALER_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def _scaler_options(name: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``grad_scaler=`` checked: a dict of :data:`SCALER_OPTIONS`, for ``16-mixed`` only."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(
            f"grad_scaler={options!r} must be a dict of GradScaler settings such as "
            "{'init_scale': 1024.0, 'growth_interval': 100}"
        )
    if name != "16-mixed":
        raise ValueError(
            f"grad_scaler={dict(options)!r} sets the GradScaler of precision='16-mixed', but precision={name!r} "
            "has none; drop grad_scaler, or use precision='16-mixed'"
        )
    unknown = sorted(set(options) - set(SCALER_OPTIONS))
    if unknown:
        raise TypeError(
            f"grad_scaler has unknown setting(s) {', '.join(unknown)}; it takes {', '.join(SCALER_OPTIONS)}"
        )
    for key, value in options.items():
        if key == "growth_interval":
            arguments.int_in_range("grad_scaler['growth_interval']", value, 1)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"grad_scaler[{key!r}]={value!r} must be a number > 0")
    if options.get("growth_factor", 2.0) <= 1 or options.get("backoff_factor", 0.5) >= 1:
        raise ValueError(
            f"grad_scaler={dict(options)!r}: growth_factor must be > 1 and backoff_factor < 1 (the defaults are "
            "2.0 and 0.5)"
        )
    return dict(options)


def check_optimizer_eps(optimizer: torch.optim.Optimizer, precision: str) -> None:
    """Refuse an optimizer whose ``eps`` is 0 in the dtype its parameters are kept in (AdamW's
    default 1e-8 in float16, under ``16-true``): ``m / (sqrt(v) + 0)`` makes every parameter whose
    gradient is 0 NaN, and one whose gradient is tiny infinite, at its first step."""
    for group in optimizer.param_groups:
        eps = group.get("eps")
        if not isinstance(eps, float) or eps <= 0:
            continue
        for dtype in {p.dtype for p in group["params"] if p.is_floating_point()}:
            if torch.tensor(eps, dtype=dtype).item() == 0:
                raise ValueError(
                    f"{type(optimizer).__name__}(eps={eps}) adds eps to parameters kept in {dtype} "
                    f"(precision={precision!r}), where {eps} is 0: a parameter whose gradient is 0 would become "
                    f"NaN at its first step; pass eps={torch.finfo(dtype).tiny:.1e} or more, or use a precision "
                    "that keeps float32 parameters ('16-mixed', 'bf16-mixed')"
                )


def fp8_refusal(device_type: str) -> Exception | None:
    """The error ``precision="fp8-mixed"`` on ``device_type`` is refused with, or None when it is
    accepted: it needs bf16 autocast, torchao's float8 training, and float8 matmul
    (``torch._scaled_mm``, probed) on the device. On the CPU torch's own ``_scaled_mm`` kernel
    multiplies the float8 matrices, so it is accepted there (real float8 rounding, no speed-up)."""
    can = supported_precisions(device_type)
    if "bf16-mixed" not in can:
        return ValueError(
            f"precision='{FP8_PRECISION}' runs under bf16 autocast (bf16-mixed), which is not supported on "
            f"{device_type}; {device_type} supports: {', '.join(can)}"
        )
    try:
        require_torchao()
    except ModuleNotFoundError as err:
        return err
    reason = fp8_unsupported_reason(device_type)
    if reason is not None:
        return ValueError(
            f"precision='{FP8_PRECISION}' is not supported on {device_type}: {reason}. "
            f"Use precision='bf16-mixed'; {device_type} supports: {', '.join(can)}"
        )
    return None


def accepted_precisions(device_type: str) -> list[str]:
    """Every precision a Rig on ``device_type`` accepts: :func:`supported_precisions`, and
    ``fp8-mixed`` where :func:`fp8_refusal` finds nothing against it (what ``torchrig env`` lists)."""
    return supported_precisions(device_type) + ([FP8_PRECISION] if fp8_refusal(device_type) is None else [])


def auto_precision(device_type: str) -> str:
    """``precision="auto"``: bf16-mixed where the device has native bf16, else 32-true.

    The CPU gets 32-true: its bf16 autocast works (you may ask for it) but on most CPUs it is
    emulated and slower than fp32, so it is never chosen for you.
    """
    if device_type != "cpu" and "bf16-mixed" in supported_precisions(device_type):
        return "bf16-mixed"
    return "32-true"


class Precision:
    """The dtypes of a run on one device type.

    Args:
        name: one of :data:`NAMES` (:data:`PRECISIONS` and ``"fp8-mixed"``), or an
            :class:`~torchrig.FP8Mixed` (``fp8-mixed`` with a choice of layers).
        device_type: the ``torch.device`` type the run uses.
        grad_scaler: for ``16-mixed``, the settings of its ``torch.amp.GradScaler``:
            ``init_scale`` (default ``2.0**16``), ``growth_factor`` (2.0), ``backoff_factor`` (0.5),
            ``growth_interval`` (2000). Pass the Precision as ``Rig(precision=...)`` or
            ``Trainer(precision=...)``.

    Example:
        >>> p = Precision(name="bf16-mixed", device_type="cpu")
        >>> with p.autocast():
        ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, *, name: str | FP8Mixed, device_type: str, grad_scaler: Mapping[str, Any] | None = None) -> None:
        self.name = normalize_precision(name)
        self.device_type = device_type
        if self.name == "auto":
            self.name = auto_precision(device_type)
        #: What ``fp8-mixed`` converts (None for every other precision).
        self.fp8: FP8Mixed | None = None
        if self.name == FP8_PRECISION:
            self.fp8 = name if isinstance(name, FP8Mixed) else FP8Mixed()
            self._check_fp8()
        else:
            can = supported_precisions(device_type)
            if self.name not in can:
                raise ValueError(
                    f"precision={self.name!r} is not supported on {device_type}; "
                    f"{device_type} supports: {', '.join(can)}"
                )
        self.param_dtype: torch.dtype | None = _TRUE_DTYPES.get(self.name)
        self.autocast_dtype: torch.dtype | None = _MIXED_DTYPES.get(self.name)
        options = _scaler_options(self.name, grad_scaler)
        #: The GradScaler of ``16-mixed`` (None otherwise), made with the ``grad_scaler`` settings.
        self.scaler: DeferredUpdateGradScaler | None = (
            DeferredUpdateGradScaler(device_type, **options) if self.name == "16-mixed" else None
        )

    def _check_fp8(self) -> None:
        """fp8-mixed needs bf16 autocast, torchao, and float8 matmul on the device: else an error."""
        refusal = fp8_refusal(self.device_type)
        if refusal is not None:
            raise refusal

    @property
    def is_mixed(self) -> bool:
        return self.autocast_dtype is not None

    @property
    def converts(self) -> bool:
        """True when parameters live in a dtype other than fp32 (``16-true``, ``bf16-true``, ``64-true``)."""
        return self.param_dtype not in (None, torch.float32)

    @property
    def converts_output(self) -> bool:
        """True when a forward can return fp16/bf16 tensors that are cast back to fp32."""
        return self.param_dtype in (torch.float16, torch.bfloat16) or self.is_mixed

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module's floating parameters and buffers for ``*-true`` precisions; under
        ``fp8-mixed``, swap the chosen ``nn.Linear`` layers for torchao ``Float8Linear`` (see
        :mod:`torchrig.fp8`)."""
        if self.fp8 is not None:
            return convert(module, self.fp8)
        return module.to(dtype=self.param_dtype) if self.converts else module

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of mixed precisions; a no-op otherwise."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    @contextlib.contextmanager
    def init_context(self) -> Iterator[None]:
        """Create floating tensors in the parameter dtype (used by ``Rig.init_module``)."""
        if not self.converts:
            yield
            return
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)  # type: ignore[arg-type]
        try:
            yield
        finally:
            torch.set_default_dtype(old)

    def convert_input(self, data: Any) -> Any:
        """Cast floating inputs to the parameter dtype (``*-true`` precisions)."""
        if not self.converts:
            return data
        dtype = self.param_dtype
        return apply_to_tensors(data, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def convert_output(self, data: Any) -> Any:
        """Cast fp16/bf16 outputs back to fp32 so the loss is computed in full precision.

        Under ``*-mixed`` autocast leaves outputs in the half dtype; a loss taken outside the
        forward would then run in half precision (or fail against an fp32 target). A prepared
        module called under autocast already (``rig.autocast()``) skips this: the loss then runs
        under autocast as well, whose fp32 ops (``log_softmax``...) upcast inside their kernels,
        without a float32 copy of the output (on a 32k-vocabulary model, 1.2% of a GPU step).
        """
        if not self.converts_output:
            return data
        if isinstance(data, torch.Tensor):  # the common case, without the traversal
            return data.float() if data.dtype in _HALF else data
        return apply_to_tensors(data, lambda t: t.float() if t.dtype in _HALF else t)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the GradScaler under fp16-mixed.

        The scale update owed by the previous iteration's optimizer steps runs first (inside
        ``scale``), so every optimizer of one iteration was unscaled with the scale its
        gradients were scaled with.
        """
        self.scaled(loss).backward(**kwargs)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as its backward runs: multiplied by the GradScaler's scale under fp16-mixed."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients of ``optimizer`` in place (once per step) before clipping."""
        if self.scaler is None:
            return
        # No deferred update here: another optimizer may already have stepped this iteration,
        # and these gradients were scaled with the scale from before that step.
        state = self.scaler._per_optimizer_states[id(optimizer)]
        if state["stage"].name != "UNSCALED":
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """Step ``optimizer``; under fp16-mixed the GradScaler skips steps with inf/NaN gradients.

        The scale is updated once per iteration, after all its optimizers stepped: the update is
        deferred to the next ``backward`` (or the next read of the scaler's scale or state); see
        :class:`DeferredUpdateGradScaler`.
        """
        if self.scaler is None:
            return optimizer.step(closure) if closure is not None else optimizer.step()
        if closure is not None:
            raise ValueError("precision='16-mixed' cannot step with a closure (GradScaler does not support it)")
        return self.scaler.step(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Precision(name={self.name!r}, device_type={self.device_type!r})"
