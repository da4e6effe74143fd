"""What ``torchrig env`` reports: the facts a bug report needs, each gathered by a guarded probe.

:func:`gather` returns a plain dict (JSON-ready). Every probe runs on its own: if one raises,
its section holds ``{"error": "..."}`` and the others still report, so the command works on a
half-broken install, which is exactly when it is needed.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

#: Optional packages worth knowing in a bug report: import name -> distribution name.
OPTIONAL_PACKAGES = {
    "numpy": "numpy",
    "psutil": "psutil",
    "rich": "rich",
    "jsonargparse": "jsonargparse",
    "safetensors": "safetensors",
    "tensorboard": "tensorboard",
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
    "lightning": "lightning",
    "pytorch_lightning": "pytorch-lightning",
    "accelerate": "accelerate",
    "transformers": "transformers",
    "deepspeed": "deepspeed",
    "ray": "ray",
    "torch_xla": "torch_xla",
    "intel_extension_for_pytorch": "intel_extension_for_pytorch",
    "torch_npu": "torch_npu",
}

DIST_BACKENDS = ("gloo", "nccl", "xccl", "mpi", "ucc")


def _error(err: BaseException) -> dict[str, str]:
    return {"error": f"{type(err).__name__}: {err}"}


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as err:  # a probe that fails is reported, never fatal
        return _error(err)


def probe_system() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def probe_torch() -> dict[str, Any]:
    import torch

    from torchrig.accelerators.torch_device import torch_build

    build = "CPU"
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    elif getattr(torch.version, "xpu", None):
        build = f"XPU {torch.version.xpu}"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return {
        "version": torch.__version__,
        "build": build,
        "description": torch_build(),
        "cudnn": cudnn,
        "current_accelerator": current.type if current is not None else None,
        "num_threads": torch.get_num_threads(),
    }


def probe_torchrig() -> dict[str, Any]:
    import torchrig
    from torchrig.resolve import auto_accelerator_name, default

    return {
        "version": torchrig.__version__,
        "location": os.path.dirname(torchrig.__file__),
        "auto_accelerator": auto_accelerator_name(),
        "default_accelerator": default("accelerator", None),
        "default_devices": default("devices", None),
        "default_precision": default("precision", None),
    }


def _device_details(mod: Any, index: int) -> dict[str, Any]:
    """Name, memory and capability of one device, from what its device module offers."""
    out: dict[str, Any] = {"index": index}
    for key, fn in (("name", "get_device_name"), ("capability", "get_device_capability")):
        f = getattr(mod, fn, None)
        if callable(f):
            value = _guarded(f, index)
            out[key] = ".".join(map(str, value)) if isinstance(value, tuple) else value
    props = getattr(mod, "get_device_properties", None)
    if callable(props):
        total = _guarded(lambda: getattr(props(index), "total_memory", None))
        if total is not None:
            out["total_memory_bytes"] = total
    return out


def _can_allocate(device_type: str) -> bool | str:
    """True, or why a tensor cannot be put on the device (a backend registered from Python only)."""
    import torch

    try:
        torch.empty(0, device=device_type)
    except (NotImplementedError, RuntimeError) as err:
        return f"no: {str(err).split('. ')[0][:200]}"
    return True


def probe_accelerator(name: str) -> dict[str, Any]:
    """One registered accelerator: available or why not, its devices, and its precisions."""
    from torchrig.accelerators import ACCELERATOR_REGISTRY, TorchDeviceAccelerator
    from torchrig.devices import device_module
    from torchrig.precision import accepted_precisions, auto_precision, fp8_refusal

    entry = ACCELERATOR_REGISTRY.entry(name)
    acc = entry.build()
    available = bool(acc.is_available())
    info: dict[str, Any] = {
        "description": entry.description,
        "class": f"{type(acc).__module__}.{type(acc).__qualname__}",
        "available": available,
    }
    if not available:
        info["reason"] = acc.unavailable_reason()
        return info
    info["device_type"] = acc.device_type
    info["device_count"] = _guarded(acc.auto_device_count)
    if isinstance(acc, TorchDeviceAccelerator) and isinstance(info["device_count"], int):
        mod = device_module(acc.device_type)
        info["devices"] = [_device_details(mod, i) for i in range(info["device_count"])]
        info["can_allocate"] = _guarded(_can_allocate, acc.device_type)
        bf16 = getattr(mod, "is_bf16_supported", None)
        if callable(bf16):
            info["bf16_supported"] = _guarded(bf16)
    precisions = _guarded(accepted_precisions, acc.device_type)
    info["supported_precisions"] = precisions
    info["fp8_refused"] = _guarded(_refusal_text, fp8_refusal, acc.device_type)
    if isinstance(precisions, list):
        info.setdefault("bf16_supported", "bf16-mixed" in precisions or "bf16-true" in precisions)
        info["fp16_supported"] = "16-mixed" in precisions or "16-true" in precisions
    info["auto_precision"] = _guarded(auto_precision, acc.device_type)
    return info


def _refusal_text(refusal: Any, device_type: str) -> str | None:
    """Why ``refusal(device_type)`` refuses (its error as ``Type: message``), or None when it accepts."""
    err = refusal(device_type)
    return None if err is None else f"{type(err).__name__}: {err}"


def probe_accelerators() -> dict[str, Any]:
    from torchrig.accelerators import ACCELERATOR_REGISTRY, ensure_registered, privateuse1_name

    pu1 = privateuse1_name()
    if pu1 is not None:  # a renamed PrivateUse1 backend shows up even before anyone selects it
        ensure_registered(pu1)
    # Each accelerator on its own: one broken plugin must not hide the others.
    return {name: _guarded(probe_accelerator, name) for name in ACCELERATOR_REGISTRY.names()}


def probe_distributed() -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False, "reason": "this PyTorch build has no torch.distributed"}
    backends: dict[str, Any] = {}
    for b in DIST_BACKENDS:
        check = getattr(dist, f"is_{b}_available", None)
        backends[b] = _guarded(check) if callable(check) else "unknown to this PyTorch"
    return {
        "available": True,
        "backends": backends,
        "default_device_backend_map": dict(dist.Backend.default_device_backend_map),
    }


def probe_cluster() -> dict[str, Any]:
    """Which launcher started this process, and why torchrig thinks so."""
    from torchrig.clusters import CLUSTER_ENVIRONMENTS

    env = CLUSTER_ENVIRONMENTS.detect()
    out: dict[str, Any] = {"detected": env.kind, "why": env.reason}
    if env.launched:
        out.update(
            global_rank=env.global_rank,
            local_rank=env.local_rank,
            node_rank=env.node_rank,
            world_size=env.world_size,
            rendezvous=f"{env.master_addr}:{env.master_port}",
        )
    job = CLUSTER_ENVIRONMENTS.job()
    out["scheduler_job"] = f"{job[0]} {job[2]}" if job is not None else None
    out["known"] = [name for name, _ in CLUSTER_ENVIRONMENTS.classes()]
    return out


def probe_precision() -> dict[str, Any]:
    """The precision of the auto-selected device: what ``"auto"`` picks and what else works."""
    from torchrig.precision import accepted_precisions, auto_precision
    from torchrig.resolve import auto_accelerator_name, default

    device_type = auto_accelerator_name()
    return {
        "device_type": device_type,
        "default": default("precision", None),
        "auto": auto_precision(device_type),
        "supported": accepted_precisions(device_type),
    }


def probe_packages() -> dict[str, str | None]:
    """Installed versions (None when missing), read from metadata without importing anything."""
    out: dict[str, str | None] = {}
    for module, dist_name in OPTIONAL_PACKAGES.items():
        try:
            out[module] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[module] = None
    return out


def gather() -> dict[str, Any]:
    """Every section of the report; a failing probe gives ``{"error": ...}`` in its place.

    Example:
        >>> info = gather()
        >>> info["accelerators"]["cpu"]["available"]
        True
    """
    # Names are looked up at each call (no table built at import), so a probe can be replaced in tests.
    return {
        "system": _guarded(probe_system),
        "torch": _guarded(probe_torch),
        "torchrig": _guarded(probe_torchrig),
        "accelerators": _guarded(probe_accelerators),
        "distributed": _guarded(probe_distributed),
        "cluster": _guarded(probe_cluster),
        "precision": _guarded(probe_precision),
        "packages": _guarded(probe_packages),
    }
