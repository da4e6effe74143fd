"""The objects ``Rig.prepare`` returns: a module that runs under the precision, and an
optimizer that steps through it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from torchrig.diagnostics import DeviceMismatchError, explain
from torchrig.precision import Precision


def as_prepared(module: Any) -> RigModule | None:
    """The ``RigModule`` that ``module`` is, or that a ``torch.compile(prepared)`` wraps
    (``OptimizedModule``); None when it is neither."""
    from torchrig.speedups import unwrap_compiled

    if isinstance(module, nn.Module):
        module = unwrap_compiled(module)[0]
    return module if isinstance(module, RigModule) else None


class RigModule(nn.Module):
    """A prepared module. Calls run under the precision's autocast and input conversion;
    attributes, ``state_dict`` and ``load_state_dict`` are those of the module you passed in.

    A device or dtype mismatch inside ``forward`` is re-raised as
    :class:`~torchrig.diagnostics.DeviceMismatchError` that says what is where.
    """

    def __init__(
        self,
        *,
        forward_module: nn.Module,
        module: nn.Module,
        precision: Precision,
        device: torch.device,
        plain: bool = False,
    ) -> None:
        super().__init__()
        self._forward_module = forward_module
        # Plain attributes (not nn.Module's __getattr__ lookups, ~0.5 µs each) for the hot path.
        object.__setattr__(self, "_rig_forward", forward_module)
        object.__setattr__(self, "_rig_module", module)
        object.__setattr__(self, "_rig_precision", precision)
        object.__setattr__(self, "_rig_device", device)
        object.__setattr__(self, "_rig_autocast", precision.autocast if precision.is_mixed else None)
        object.__setattr__(self, "_rig_converts", precision.converts)
        object.__setattr__(self, "_rig_converts_output", precision.converts_output)
        object.__setattr__(self, "_rig_device_type", precision.device_type)
        # True when calling the module's methods directly is the same as running its forward
        # through the wrapper: the strategy wrapped nothing, the precision adds no autocast or casts.
        object.__setattr__(
            self,
            "_rig_plain",
            plain
            and forward_module is module
            and not (precision.is_mixed or precision.converts or precision.converts_output),
        )

    @property
    def module(self) -> nn.Module:
        """The module you passed to ``prepare`` (unwrapped)."""
        return self._rig_module  # type: ignore[no-any-return]

    # The wrapped module runs nn.Module.__call__ (its hooks, global hooks); the wrapper skips
    # that bookkeeping, a few microseconds a step, unless hooks were registered on it.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward_hooks or self._forward_pre_hooks:
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._rig_run(self._rig_forward, args, kwargs)

    def _rig_run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` under the precision: input casts, autocast, output casts; a
        device or dtype mismatch re-raised as :class:`DeviceMismatchError`."""
        precision = self._rig_precision
        if self._rig_converts:
            args, kwargs = precision.convert_input((args, kwargs))
        converts_output = self._rig_converts_output
        try:
            if self._rig_autocast is None:
                out = fn(*args, **kwargs)
            else:
                # Called under autocast already (``rig.autocast()``): the loss that follows runs
                # under it too, as in a hand-written loop, so half outputs stay half.
                converts_output = converts_output and not torch.is_autocast_enabled(self._rig_device_type)
                with self._rig_autocast():
                    out = fn(*args, **kwargs)
        except RuntimeError as err:
            self._rig_reraise(err, args, kwargs)
        return precision.convert_output(out) if converts_output else out

    def _rig_reraise(self, err: RuntimeError, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        """Raise ``err``, as a :class:`DeviceMismatchError` when it is a device/dtype mismatch."""
        message = explain(err, self._rig_module, args, kwargs, self._rig_device)
        if message is None:
            raise err
        raise DeviceMismatchError(message) from err

    def step_caller(self, method: Any) -> Callable[..., Any]:
        """``method`` (the module's ``training_step``...) as a callable that runs it as if it were
        the module's ``forward``, for calling once per batch.

        The strategy's wrapper (DDP's gradient hooks, FSDP's unsharding) and the precision's
        autocast then see the step as the forward pass; inside it, ``self(x)`` is the module's own
        ``forward`` again. When nothing wraps the forward (one device, full precision) the method
        is simply called: the same result, without the detour, as long as no module hook exists.
        This is the one place that reads torch's hook registries (:func:`_hook_dicts`): each call
        checks that no hook was registered since (a hook sends the call the wrapper's way, so the
        hooks see the step as the forward pass).
        """
        if not self._rig_plain:
            return lambda *args: self._call_swapped(method, *args)
        hooks = (self._forward_hooks, self._forward_pre_hooks, *_hook_dicts(self._rig_module))
        reraise = self._rig_reraise

        def call(*args: Any) -> Any:
            if any(hooks):
                return self._call_swapped(method, *args)
            try:
                return method(*args)
            except RuntimeError as err:
                reraise(err, args, {})

        return call

    def direct_caller(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (the module's ``training_step``...) run under the precision (input casts,
        autocast, output casts) but *not* as the wrapped module's forward: the strategy's wrapper
        sees only the calls made inside it (``self(x)``, a submodule's call), each as a forward of
        its own. A device or dtype mismatch is re-raised as in ``forward``."""
        run = self._rig_run
        return lambda *args: run(method, args, {})

    def _call_swapped(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` run as the module's ``forward``, through the wrapper's ``__call__``."""
        attrs = self._rig_module.__dict__  # the instance dict, past nn.Module's slower __setattr__

        def step_forward(*a: Any) -> Any:
            attrs.pop("forward", None)
            return method(*a)

        attrs["forward"] = step_forward
        try:
            return self(*args)
        finally:
            attrs.pop("forward", None)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._rig_module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # ``model.head = nn.Linear(...)`` after prepare must change the module that runs, not
        # the wrapper (the new submodule is then on the CPU until moved: diagnostics say so).
        if name == "_forward_module":
            object.__setattr__(self, "_rig_forward", value)
            super().__setattr__(name, value)
        elif name in self.__dict__:
            super().__setattr__(name, value)
        else:
            setattr(self._rig_module, name, value)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._rig_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._rig_module.load_state_dict(state_dict, strict=strict, assign=assign)


def _hook_dicts(module: nn.Module) -> tuple[dict[Any, Any], ...]:
    """The hook registries ``module.__call__`` runs: the module's own and the global ones.
    (Registering a hook adds to one of these dicts; none of them is ever replaced.)"""
    return (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
        _nn_module._global_forward_hooks,
        _nn_module._global_forward_pre_hooks,
        _nn_module._global_backward_hooks,
        _nn_module._global_backward_pre_hooks,
    )


_OWN = ("_rig_optimizer", "_rig_precision", "step", "zero_grad")


class RigOptimizer:
    """Marker base of prepared optimizers; see :func:`wrap_optimizer`."""

    _rig_optimizer: torch.optim.Optimizer
    _rig_precision: Precision

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step through the precision (the GradScaler skips steps with inf/NaN gradients)."""
        if self._rig_precision.scaler is None:  # no detour through the precision
            return self._rig_optimizer.step() if closure is None else self._rig_optimizer.step(closure)
        return self._rig_precision.optimizer_step(self._rig_optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._rig_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._rig_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rig_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._rig_optimizer.add_param_group(param_group)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer you passed to ``prepare``."""
        return self._rig_optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rig_optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # ``step``/``zero_grad`` patches (an LR scheduler's step counter) stay on the wrapper so
        # they wrap *this* step; everything else is state of the real optimizer.
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._rig_optimizer, name, value)

    def __repr__(self) -> str:
        return f"Rig{self._rig_optimizer!r}"


def wrap_optimizer(optimizer: torch.optim.Optimizer, precision: Precision) -> torch.optim.Optimizer:
    """A proxy that ``isinstance``-checks as ``type(optimizer)`` and shares all its state."""
    cls = type(f"Rig{type(optimizer).__name__}", (RigOptimizer, type(optimizer)), {})
    proxy: Any = object.__new__(cls)
    object.__setattr__(proxy, "_rig_optimizer", optimizer)
    object.__setattr__(proxy, "_rig_precision", precision)
    if precision.scaler is not None:  # its steps count towards the scaler's iteration
        precision.scaler.track(optimizer)
    return proxy  # type: ignore[no-any-return]
