"""Resolution: the user's strings -> one frozen plan. The one place that validates combinations.

``Rig`` and ``Trainer`` both call :func:`resolve`; every error message about a bad
``accelerator=``, ``devices=``, ``strategy=``, ``precision=`` or ``num_nodes=`` is written here
(or in :mod:`torchrig.devices` / :mod:`torchrig.precision`, which it calls).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from torchrig.accelerators import ACCELERATOR_REGISTRY, Accelerator, ensure_registered
from torchrig.arguments import int_in_range
from torchrig.fp8 import FP8_PRECISION, FP8Mixed
from torchrig.precision import NAMES, Precision, normalize_precision
from torchrig.strategies import STRATEGY_REGISTRY, Strategy
from torchrig.strategies.single import SingleDeviceStrategy

#: Environment variables that ``torchrig run`` sets and ``Rig()``/``Trainer()`` read as defaults.
ENV_DEFAULTS = {
    "accelerator": "TORCHRIG_ACCELERATOR",
    "devices": "TORCHRIG_DEVICES",
    "strategy": "TORCHRIG_STRATEGY",
    "precision": "TORCHRIG_PRECISION",
    "num_nodes": "TORCHRIG_NUM_NODES",
}
DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "devices": "auto",
    "strategy": "auto",
    "precision": "32-true",
    "num_nodes": 1,
}


@dataclass(frozen=True)
class Plan:
    """What a run uses: the accelerator, strategy and precision, side by side."""

    accelerator: Accelerator
    strategy: Strategy
    precision: Precision
    devices: tuple[torch.device, ...]
    num_nodes: int


def default(name: str, value: Any) -> Any:
    """``value`` if given, else the ``TORCHRIG_*`` environment variable, else the default."""
    if value is not None:
        return value
    env = os.environ.get(ENV_DEFAULTS[name])
    if env:
        return int(env) if name == "num_nodes" else env
    return DEFAULTS[name]


def auto_accelerator_name() -> str:
    """What ``accelerator="auto"`` selects: ``torch.accelerator.current_accelerator()``, else cpu."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return "cpu"
    ensure_registered(acc.type)
    return acc.type


#: What every Accelerator subclass must define (the base class's raise NotImplementedError).
_ACCELERATOR_API = ("parse_devices", "get_parallel_devices", "auto_device_count", "is_available")


def resolve_accelerator(accelerator: Any) -> Accelerator:
    """An :class:`Accelerator` from a name, a class, or an instance."""
    if isinstance(accelerator, Accelerator):
        acc = accelerator
    elif isinstance(accelerator, type) and issubclass(accelerator, Accelerator):
        acc = accelerator()
    elif isinstance(accelerator, str):
        acc = _accelerator_by_name(accelerator.strip().lower())
    else:
        raise TypeError(
            f"accelerator={accelerator!r} must be a name ({', '.join(ACCELERATOR_REGISTRY.names())}, "
            "auto, gpu) or an Accelerator instance"
        )
    missing = [m for m in _ACCELERATOR_API if getattr(type(acc), m) is getattr(Accelerator, m)]
    if missing:
        raise TypeError(
            f"accelerator={acc!r} does not define {', '.join(missing)}; a subclass of "
            f"torchrig.Accelerator defines the static methods {', '.join(_ACCELERATOR_API)} "
            "(examples/custom_accelerator.py is a complete one)"
        )
    if not acc.is_available():
        available = ", ".join(ACCELERATOR_REGISTRY.available_accelerators())
        raise ValueError(
            f"accelerator={acc.name()!r} is not available: {acc.unavailable_reason()}. "
            f"Available here: {available}; or use accelerator='auto'"
        )
    return acc


def _accelerator_by_name(name: str) -> Accelerator:
    if name == "auto":
        name = auto_accelerator_name()
    elif name == "gpu":
        found = auto_accelerator_name()
        if found == "cpu":
            reasons = "; ".join(
                f"{t}: {ACCELERATOR_REGISTRY.get(t).unavailable_reason()}" for t in ("cuda", "mps", "xpu")
            )
            raise ValueError(f"accelerator='gpu' found no GPU ({reasons}); use accelerator='cpu' or 'auto'")
        name = found
    elif name not in ACCELERATOR_REGISTRY:
        ensure_registered(name)
    return ACCELERATOR_REGISTRY.get(name)


def resolve_devices(acc: Accelerator, devices: Any) -> list[torch.device]:
    """The device of every local process, validated against what the machine has."""
    if devices in ("auto", -1, "-1") or (isinstance(devices, str) and devices.strip().lower() == "auto"):
        count = acc.auto_device_count()
        if count < 1:
            raise ValueError(f"devices={devices!r}: the {acc.name()} accelerator reports no device")
        devices = count
    parsed = acc.parse_devices(devices)
    try:
        found = acc.get_parallel_devices(parsed)
    except TypeError:
        if not isinstance(parsed, int):
            raise
        # A user accelerator (like the reference XPU example) may expect indices, not a count.
        found = acc.get_parallel_devices(list(range(parsed)))
    return [torch.device(d) for d in found]


def resolve_strategy(strategy: Any, devices: list[torch.device], num_nodes: int) -> Strategy:
    """A :class:`Strategy` from a name or an instance, checked against the devices."""
    if isinstance(strategy, Strategy):
        chosen, given = strategy, repr(strategy)
    elif isinstance(strategy, str):
        name = strategy.strip().lower()
        if name == "auto":
            name = "single" if len(devices) == 1 and num_nodes == 1 and _launched_world_size() == 1 else "ddp"
        chosen, given = STRATEGY_REGISTRY.get(name), repr(name)
    else:
        raise TypeError(f"strategy={strategy!r} must be a name ({', '.join(STRATEGY_REGISTRY.names())}) or a Strategy")
    if isinstance(chosen, SingleDeviceStrategy) and (len(devices) > 1 or num_nodes > 1):
        raise ValueError(
            f"strategy={given} runs one process on one device, but {len(devices)} device(s) on "
            f"{num_nodes} node(s) were asked for; use strategy='ddp' (or 'fsdp'), or devices=1"
        )
    return chosen


def resolve_precision(precision: Any, device_type: str) -> Precision:
    """A :class:`Precision` from a name, or the instance given, checked against the device type."""
    if isinstance(precision, Precision):
        if precision.device_type != device_type:
            raise ValueError(
                f"precision=Precision(name={precision.name!r}, device_type={precision.device_type!r}) was made for "
                f"{precision.device_type}, but this run's devices are {device_type}; pass "
                f"precision={precision.name!r}, or make it with device_type={device_type!r}"
            )
        return precision
    return Precision(name=precision, device_type=device_type)


def check_launch_choices(*, strategy: Any, precision: Any, devices: list[torch.device], num_nodes: int) -> None:
    """What a launcher checks before it starts any process, without touching a device: the
    precision's name, and the strategy's name and whether it fits ``devices`` x ``num_nodes``.
    ``None`` is not given (the script decides). Errors name the option (``--precision``).

    Raises:
        ValueError: an unknown name, or a strategy that cannot run on these devices.
    """
    if precision is not None:
        _checked("precision", precision, "--precision")
    if strategy is not None:
        name = _checked("strategy", strategy, "--strategy")
        try:
            resolve_strategy(name, devices, num_nodes)
        except ValueError as err:
            raise ValueError(str(err).replace("strategy=", "--strategy ", 1)) from None


# -- what an accelerator carries ----------------------------------------------------------
# ``CPUAccelerator(precision="bf16-mixed", strategy="ddp")``: the Accelerator documents hand the
# Trainer one object holding its precision and training-type plugins. Rig/Trainer use what the
# accelerator carries when their own argument is not given; two different values are an error.


def _checked(kind: str, value: Any, arg: str) -> Any:
    """``value`` for ``kind`` ("precision" or "strategy") in canonical form; ``arg`` names it in errors."""
    if kind == "precision":
        if isinstance(value, (Precision, FP8Mixed)):
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TypeError(
                f"{arg}={value!r} must be a precision name ({', '.join(NAMES)}, auto), "
                "a torchrig.Precision or a torchrig.FP8Mixed"
            )
        try:
            return normalize_precision(value)
        except ValueError as err:
            raise ValueError(str(err).replace("precision=", f"{arg}=", 1)) from None
    if isinstance(value, Strategy):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{arg}={value!r} must be a strategy name ({', '.join(STRATEGY_REGISTRY.names())}, auto) or a Strategy"
        )
    name = value.strip().lower()
    if name != "auto" and name not in STRATEGY_REGISTRY:
        raise ValueError(f"{arg}={value!r}: {STRATEGY_REGISTRY.unknown_name_message(name)}")
    return name


def _precision_key(precision: Any) -> tuple[str, FP8Mixed | None]:
    """What a checked precision asks for: its name, and for fp8-mixed which layers it converts and how."""
    if isinstance(precision, Precision):
        return precision.name, precision.fp8
    if isinstance(precision, FP8Mixed):
        return FP8_PRECISION, precision
    return precision, (FP8Mixed() if precision == FP8_PRECISION else None)


def _agree(kind: str, a: Any, b: Any) -> bool:
    """Whether two checked precisions, or two checked strategies, ask for the same thing.

    Precisions agree when their names do (and, for fp8-mixed, their FP8Mixed settings). Two
    strategy names agree when equal; a name and a Strategy when the name builds that class with
    the same settings (its repr); two different Strategy objects never do (which would be used?).
    """
    if a is b:
        return True
    if kind == "precision":
        return _precision_key(a) == _precision_key(b)
    if isinstance(a, Strategy) and isinstance(b, str):
        a, b = b, a
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    if isinstance(a, str) and isinstance(b, Strategy) and a != "auto":
        built = STRATEGY_REGISTRY.get(a)
        return type(built) is type(b) and repr(built) == repr(b)
    return False


#: What a carried or given choice may be besides a name; an object is kept rather than rebuilt.
_OBJECTS = (Precision, FP8Mixed, Strategy)


def carried_choice(owner: str, kind: str, value: Any, alias: str, alias_value: Any) -> Any:
    """What an accelerator carries for ``kind`` from ``kind=`` and its documents' name ``alias=``.

    Returns the checked value (a canonical name or the object), or None when neither was given.

    Raises:
        ValueError: both were given and disagree (the message names both values).
    """
    a = None if value is None else _checked(kind, value, kind)
    b = None if alias_value is None else _checked(kind, alias_value, alias)
    if a is None or b is None:
        return a if b is None else b
    if not _agree(kind, a, b):
        raise ValueError(
            f"{owner} got {kind}={value!r} and {alias}={alias_value!r}, which disagree; "
            f"{alias}= is another name for {kind}=, so give only one of them"
        )
    return b if isinstance(b, _OBJECTS) else a


def with_carried(kind: str, given: Any, acc: Accelerator) -> Any:
    """``given`` (the Rig's own ``precision=``/``strategy=``), else what ``acc`` carries.

    An accelerator whose subclass never called ``Accelerator.__init__`` carries nothing.

    Raises:
        ValueError: both are given and disagree (the message names both values).
    """
    carried = getattr(acc, kind, None)
    if carried is None:
        return given
    carried = _checked(kind, carried, f"{type(acc).__name__}.{kind}")
    if given is None:
        return carried
    if _agree(kind, _checked(kind, given, kind), carried):
        return carried if isinstance(carried, _OBJECTS) else given
    both_objects = isinstance(given, Strategy) and isinstance(carried, Strategy)
    raise ValueError(
        f"{kind}={given!r} was given, but the accelerator {acc.name()!r} carries {kind}={carried!r}"
        + (" (a different object)" if both_objects else "")
        + f"; give the {kind} in one place: on the accelerator, or as {kind}= of Rig/Trainer"
    )


def _launched_world_size() -> int:
    """The world size of a job started by torchrun/SLURM around this process (1 when none)."""
    from torchrig.clusters import detect_environment

    return detect_environment().world_size


def resolve(
    *,
    accelerator: Any = None,
    devices: Any = None,
    strategy: Any = None,
    precision: Any = None,
    num_nodes: Any = None,
) -> Plan:
    """Turn user choices (``None`` = environment default, then built-in default) into a Plan.

    A ``precision``/``strategy`` left ``None`` is taken from the accelerator when it carries one
    (``CPUAccelerator(precision="bf16-mixed")``), before the environment and the default.

    Example:
        >>> plan = resolve(accelerator="cpu", precision="bf16")
        >>> plan.precision.name, plan.strategy
        ('bf16-mixed', SingleDeviceStrategy())
    """
    nodes = int_in_range("num_nodes", default("num_nodes", num_nodes), 1, hint=" (the number of machines)")
    acc = resolve_accelerator(default("accelerator", accelerator))
    strategy = with_carried("strategy", strategy, acc)
    precision = with_carried("precision", precision, acc)
    devs = resolve_devices(acc, default("devices", devices))
    strat = resolve_strategy(default("strategy", strategy), devs, nodes)
    prec = resolve_precision(default("precision", precision), devs[0].type)
    strat.bind(accelerator=acc, devices=devs, precision=prec, num_nodes=nodes)
    return Plan(accelerator=acc, strategy=strat, precision=prec, devices=tuple(devs), num_nodes=nodes)
