"""Parsing of ``devices=``: counts, ``-1``/``"auto"``, index strings and index lists.

Two steps: :func:`normalize_devices` checks the *form* of the value (a positive count, all, or a
list of distinct non-negative indices) and :func:`select_indices` checks it against what the
machine has. Both raise ``ValueError``/``TypeError`` that say what was asked, what was found,
and how to fix it.
"""

from __future__ import annotations

import operator
import re
from types import ModuleType
from typing import Any

from torchrig.arguments import shown

ALL = -1

#: The most processes, or the highest index, ``devices=`` may name: far above any machine, and
#: small enough for every index-sized integer the accelerators pass it to.
MOST = 2**16

_FORMS = (
    "a positive count (devices=2), -1 or 'auto' for all, an index string ('0,1' or '1,'), or a list of indices ([0, 1])"
)


_INT = re.compile(r"-?[0-9]+")  # ASCII digits only: int() also accepts other scripts' digits and "1_0"


def _int_from_str(text: str, original: Any) -> int:
    text = text.strip()
    if not _INT.fullmatch(text):
        raise ValueError(f"devices={original!r} is not a number or a list of indices; use {_FORMS}")
    return int(text)


def _index(item: Any, original: Any) -> int:
    """An index from a list item: ints and int-likes (numpy ints), never bools or floats."""
    if isinstance(item, bool):
        raise TypeError(f"devices={original!r} holds {item!r} (a bool); indices must be ints such as [0, 1]")
    try:
        return operator.index(item)
    except TypeError:
        raise TypeError(
            f"devices={original!r} holds {item!r} ({type(item).__name__}); indices must be ints such as [0, 1]"
        ) from None


def normalize_devices(devices: Any) -> int | list[int]:
    """Check the form of ``devices`` and return ``-1`` (all), a positive count, or indices.

    Example:
        >>> normalize_devices("0,1"), normalize_devices(2), normalize_devices("auto")
        ([0, 1], 2, -1)
    """
    if isinstance(devices, bool):
        raise TypeError(f"devices={devices!r} is a bool; use {_FORMS}")
    if isinstance(devices, int):
        return _check_count(devices, devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text.lower() == "auto":
            return ALL
        if "," in text:
            parts = [p for p in text.split(",") if p.strip()]
            if not parts:
                raise ValueError(f"devices={devices!r} names no device index; use {_FORMS}")
            return _check_indices([_int_from_str(p, devices) for p in parts], devices)
        return _check_count(_int_from_str(text, devices), devices)
    if isinstance(devices, (list, tuple)):
        return _check_indices([_index(d, devices) for d in devices], devices)
    raise TypeError(f"devices={devices!r} has type {type(devices).__name__}; use {_FORMS}")


def _check_count(n: int, original: Any) -> int:
    if n == ALL:
        return ALL
    if n == 0:
        raise ValueError(
            f"devices={original!r} asks for no device; use a positive count such as devices=1, or -1 for all"
        )
    if n < 0:
        raise ValueError(f"devices={shown(original)} is negative; the only negative value allowed is -1 (all)")
    if n > MOST:
        raise ValueError(f"devices={shown(original)} asks for more than {MOST} devices; use a count such as devices=2")
    return n


def _check_indices(indices: list[int], original: Any) -> list[int]:
    if not indices:
        raise ValueError(f"devices={original!r} is empty; list at least one index, such as [0]")
    negative = [i for i in indices if i < 0]
    if negative:
        raise ValueError(f"devices={original!r} holds negative indices {negative}; indices start at 0")
    if max(indices) > MOST:
        raise ValueError(f"devices={shown(original)} holds an index above {MOST}; indices are such as [0, 1]")
    dupes = sorted({i for i in indices if indices.count(i) > 1})
    if dupes:
        raise ValueError(
            f"devices={original!r} repeats index {dupes[0]}; each device can be used once: "
            f"devices={sorted(set(indices))}"
        )
    return indices


def select_indices(devices: Any, *, device_type: str, available: int) -> list[int]:
    """Resolve ``devices`` to concrete indices among ``available`` devices of ``device_type``.

    Example:
        >>> select_indices(2, device_type="cuda", available=4)
        [0, 1]
        >>> select_indices([3], device_type="cuda", available=2)
        Traceback (most recent call last):
        ...
        ValueError: devices=[3] asks for cuda:3, but this machine has 2 cuda devices: [0, 1]
    """
    spec = normalize_devices(devices)
    have = list(range(available))
    if available <= 0:
        raise ValueError(
            f"devices={devices!r} asks for {device_type} devices, but this machine has none; "
            "use accelerator='cpu' or accelerator='auto'"
        )
    if spec == ALL:
        return have
    if isinstance(spec, int):
        if spec > available:
            raise ValueError(
                f"devices={devices!r} asks for {spec} {device_type} devices, but this machine has "
                f"{available}: {have}; use devices={available} or devices=-1"
            )
        return have[:spec]
    missing = [i for i in spec if i >= available]
    if missing:
        asked = ", ".join(f"{device_type}:{i}" for i in missing)
        raise ValueError(
            f"devices={devices!r} asks for {asked}, but this machine has {available} "
            f"{device_type} device{'s' if available != 1 else ''}: {have}"
        )
    return spec


def parse_process_count(devices: Any, *, auto: int = 1) -> int:
    """``devices=`` for the CPU: how many processes (``-1``/``"auto"`` give ``auto``)."""
    spec = normalize_devices(devices)
    if isinstance(spec, list):
        raise ValueError(
            f"devices={devices!r} lists device indices, but for the CPU devices= is the number of "
            f"processes; use devices={len(spec)}"
        )
    return auto if spec == ALL else spec


def device_module(device_type: str) -> ModuleType | None:
    """``torch.cuda``, ``torch.mps``, ``torch.xpu``, ``torch.<privateuse1>``... for a device type;
    None when PyTorch has no module for it (``torch.get_device_module`` raises ``RuntimeError``
    for an unknown type, or one whose module is not registered, such as ``meta`` or ``xla``).

    The one place torchrig looks a device module up; for ``"cpu"`` it is ``torch.cpu``.

    Example:
        >>> device_module("cpu").__name__, device_module("meta")
        ('torch.cpu', None)
    """
    import torch

    try:
        return torch.get_device_module(device_type)
    except RuntimeError:
        return None


def _require_accelerator(what: str) -> str:
    import torch

    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        raise RuntimeError(
            f"{what} needs an accelerator, but torch.accelerator finds none here (CPU only); "
            "the CPU has no device index to get or set"
        )
    return acc.type


def _module_fallback(kind: str, fn: str, err: RuntimeError, *args: int) -> Any:
    """Call ``torch.<kind>.<fn>(*args)`` when ``torch.accelerator`` cannot.

    ``torch.accelerator``'s device-index functions need the backend's C++ device guard; a backend
    registered from Python only (``torch._register_device_module``) still has the module
    functions the PrivateUse1 documentation asks for (``current_device``, ``set_device``).
    """
    f = getattr(device_module(kind), fn, None)
    if not callable(f):
        raise RuntimeError(
            f"torch.accelerator cannot handle device indices of {kind!r} ({err}), "
            f"and torch.{kind} has no {fn}() to fall back on"
        ) from err
    return f(*args)


def current_device_index() -> int:
    """The index of the current accelerator device (``torch.accelerator``), for any backend.

    Example:
        >>> # on a machine with an accelerator: torchrig.current_device_index() -> 0
    """
    import torch

    kind = _require_accelerator("current_device_index()")
    try:
        return int(torch.accelerator.current_device_index())
    except RuntimeError as err:
        return int(_module_fallback(kind, "current_device", err))


def set_device_index(index: int) -> None:
    """Make accelerator device ``index`` current, for any backend.

    Example:
        >>> # on a machine with two GPUs: torchrig.set_device_index(1)
    """
    import torch

    kind = _require_accelerator("set_device_index()")
    select_indices([index], device_type=kind, available=torch.accelerator.device_count())
    try:
        torch.accelerator.set_device_index(index)
    except RuntimeError as err:
        _module_fallback(kind, "set_device", err, index)


class device_index:  # noqa: N801 - a context manager named like torch.accelerator.device_index
    """Select accelerator device ``index`` for a block, restoring the previous one after.

    Example:
        >>> # with torchrig.device_index(1): x = torch.ones(1, device=rig.device.type)
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self._previous: int | None = None

    def __enter__(self) -> int:
        self._previous = current_device_index()
        set_device_index(self.index)
        return self.index

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            set_device_index(self._previous)
