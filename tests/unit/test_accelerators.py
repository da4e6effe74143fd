"""The Accelerator API, the built-ins, selection by name/instance, and the not-available reasons."""

from __future__ import annotations

import inspect
import platform
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torchrig import ACCELERATOR_REGISTRY, Accelerator, CPUAccelerator, TorchDeviceAccelerator, XLAAccelerator
from torchrig.resolve import auto_accelerator_name, resolve

pytestmark = pytest.mark.timeout(30)

CPU_ONLY_BUILD = not (torch.version.cuda or getattr(torch.version, "hip", None) or getattr(torch.version, "xpu", None))
cpu_build_only = pytest.mark.skipif(not CPU_ONLY_BUILD, reason="checks the messages of a CPU-only torch build")


@pytest.fixture(autouse=True)
def restore_global_registry() -> Iterator[None]:
    saved = (dict(ACCELERATOR_REGISTRY._entries), dict(ACCELERATOR_REGISTRY._shadowed))
    yield
    ACCELERATOR_REGISTRY._entries, ACCELERATOR_REGISTRY._shadowed = saved


@pytest.mark.parametrize("name", ["parse_devices", "get_parallel_devices", "auto_device_count", "is_available"])
def test_static_methods_of_the_api(name: str) -> None:
    assert isinstance(inspect.getattr_static(Accelerator, name), staticmethod)
    assert isinstance(inspect.getattr_static(CPUAccelerator, name), staticmethod)
    with pytest.raises(NotImplementedError):
        getattr(Accelerator, name)(*([1] if "devices" in name else []))


def test_instance_and_class_methods_of_the_api() -> None:
    for name in ("name", "get_device_stats", "setup_device", "teardown"):
        assert inspect.isfunction(inspect.getattr_static(Accelerator, name)), name
    assert isinstance(inspect.getattr_static(Accelerator, "register_accelerators"), classmethod)
    cpu = CPUAccelerator()
    assert cpu.name() == "cpu"
    cpu.setup_device(torch.device("cpu"))
    cpu.teardown()


def test_cpu_accelerator() -> None:
    assert CPUAccelerator.is_available() and CPUAccelerator.auto_device_count() == 1
    stats = CPUAccelerator().get_device_stats("cpu")
    assert set(stats) == {
        "cpu_percent",
        "process_rss_bytes",
        "system_memory_used_bytes",
        "system_memory_total_bytes",
        "system_memory_percent",
    }
    assert stats["process_rss_bytes"] > 0 and stats["system_memory_total_bytes"] >= stats["system_memory_used_bytes"]


def test_builtins_are_registered_under_their_own_names() -> None:
    for t in ("cuda", "mps", "xpu", "hpu", "npu"):
        acc = ACCELERATOR_REGISTRY.get(t)
        assert isinstance(acc, TorchDeviceAccelerator) and acc.device_type == t and acc.name() == t
    assert type(ACCELERATOR_REGISTRY.get("cpu")) is CPUAccelerator
    assert type(ACCELERATOR_REGISTRY.get("tpu")) is XLAAccelerator and ACCELERATOR_REGISTRY.get("xla").name() == "xla"


@pytest.mark.skipif(torch.accelerator.is_available(), reason="a machine with an accelerator picks it")
def test_auto_is_cpu_here() -> None:
    assert auto_accelerator_name() == "cpu"
    plan = resolve(accelerator="auto")
    assert type(plan.accelerator) is CPUAccelerator and plan.devices == (torch.device("cpu"),)


def test_accelerator_by_instance_and_by_class() -> None:
    cpu = CPUAccelerator()
    assert resolve(accelerator=cpu).accelerator is cpu
    assert type(resolve(accelerator=CPUAccelerator).accelerator) is CPUAccelerator
    with pytest.raises(TypeError, match=r"accelerator=3 must be a name \(cpu, cuda, .*auto, gpu\) or an Accelerator"):
        resolve(accelerator=3)


def test_unknown_accelerator_name_suggests_the_nearest() -> None:
    with pytest.raises(ValueError) as err:
        resolve(accelerator="cdua")
    assert str(err.value).startswith("unknown accelerator 'cdua'; known: cpu, cuda")
    assert str(err.value).endswith("Did you mean 'cuda'?")


@cpu_build_only
def test_cuda_unavailable_says_this_build_has_no_cuda() -> None:
    with pytest.raises(ValueError) as err:
        resolve(accelerator="cuda")
    assert str(err.value) == (
        f"accelerator='cuda' is not available: this PyTorch build has no CUDA: torch {torch.__version__} "
        "(a build with no CUDA/ROCm/XPU); install a CUDA build of torch. Available here: cpu; "
        "or use accelerator='auto'"
    )


def test_cuda_build_without_a_visible_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = ACCELERATOR_REGISTRY.get("cuda").unavailable_reason()
    assert reason == (
        f"torch {torch.__version__} built with CUDA 12.8, but no CUDA device is visible "
        "(driver, or CUDA_VISIBLE_DEVICES)"
    )


@pytest.mark.skipif(platform.system() == "Darwin", reason="checks a non-Mac machine")
def test_mps_needs_macos() -> None:
    with pytest.raises(ValueError) as err:
        resolve(accelerator="mps")
    assert f"MPS needs macOS on Apple silicon; this is {platform.system()} {platform.machine()}" in str(err.value)


@pytest.mark.parametrize("name", ["xla", "tpu"])
def test_xla_without_torch_xla(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch_xla" else real(n, *a))
    with pytest.raises(ValueError) as err:
        resolve(accelerator=name)
    assert str(err.value).startswith(
        f"accelerator={name!r} is not available: torch_xla is not installed (pip install torch_xla on a TPU host)"
    )


@cpu_build_only
def test_xpu_unavailable_reason() -> None:
    assert ACCELERATOR_REGISTRY.get("xpu").unavailable_reason().startswith("this PyTorch build has no XPU support")


def test_a_backend_whose_package_is_not_imported() -> None:
    assert ACCELERATOR_REGISTRY.get("npu").unavailable_reason() == (
        "PyTorch has no device module for 'npu' (the backend's package is not imported)"
    )


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks a machine without a GPU")
def test_gpu_alias_finds_no_gpu_here() -> None:
    with pytest.raises(ValueError) as err:
        resolve(accelerator="gpu")
    msg = str(err.value)
    assert msg.startswith("accelerator='gpu' found no GPU (cuda: ")
    assert "; mps: MPS needs macOS on Apple silicon" in msg
    assert msg.endswith("; use accelerator='cpu' or 'auto'")


def test_generic_stats_never_raise_without_the_device() -> None:
    if not torch.cuda.is_available():  # no zeros made up for a device that is not there
        assert ACCELERATOR_REGISTRY.get("cuda").get_device_stats("cuda:0") == {}


def test_generic_accelerator_uses_the_device_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generic class asks torch.get_device_module(type) and nothing vendor-specific."""
    import types

    fake = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 3, memory_allocated=lambda d: 42)
    monkeypatch.setattr(torch, "get_device_module", lambda t: fake if t == "hpu" else None)
    acc = TorchDeviceAccelerator(device_type="hpu")
    assert acc.is_available() and acc.auto_device_count() == 3
    assert acc.parse_devices("auto") == [0, 1, 2]
    assert acc.get_parallel_devices("0,2") == [torch.device("hpu", 0), torch.device("hpu", 2)]
    assert acc.get_device_stats("hpu:0") == {"allocated_bytes": 42}  # from the module, after torch.accelerator
    with pytest.raises(ValueError, match=r"^devices=\[3\] asks for hpu:3, but this machine has 3 hpu devices"):
        acc.parse_devices([3])


# -- a user-written accelerator -----------------------------------------------------------
class _CPUBacked(Accelerator):
    device_type = "cpu"

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        return devices  # as in the reference recipe: no parsing

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cpu") for _ in devices]  # expects indices, as in the recipe

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True


def test_an_unregistered_user_accelerator_works_as_an_instance() -> None:
    acc = _CPUBacked()
    plan = resolve(accelerator=acc, devices=1)  # a count, though get_parallel_devices wants indices
    assert plan.accelerator is acc and plan.devices == (torch.device("cpu"),)
    assert acc.name() == "_CPUBacked"


def test_defining_register_accelerators_makes_the_name_selectable() -> None:
    class SimAccelerator(_CPUBacked):
        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register("sim_test", cls, description="simulated")

    # No call of ours: defining the class registered it.
    assert ACCELERATOR_REGISTRY.describe()["sim_test"] == "simulated"
    plan = resolve(accelerator="sim_test", devices=[0])
    assert type(plan.accelerator) is SimAccelerator and plan.accelerator.name() == "sim_test"


def test_the_reference_xpu_example_shadows_the_builtin_until_removed() -> None:
    class XPUAccelerator(_CPUBacked):
        """The recipe's fictional XPU, registered under "xpu" exactly as the recipe does."""

        def get_device_stats(self, device: str | torch.device) -> dict[str, Any]:
            return {}

        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register(
                "xpu", cls, description="XPU Accelerator - optimized for large-scale machine learning."
            )

    plan = resolve(accelerator="xpu", devices=1)
    assert type(plan.accelerator) is XPUAccelerator and plan.accelerator.name() == "xpu"
    ACCELERATOR_REGISTRY.remove("xpu")  # the built-in generic xpu comes back
    back = ACCELERATOR_REGISTRY.get("xpu")
    assert type(back) is TorchDeviceAccelerator and back.device_type == "xpu"
    assert ACCELERATOR_REGISTRY.describe()["xpu"] == "Intel GPUs"


def test_a_user_class_cannot_silently_take_a_user_name() -> None:
    class First(_CPUBacked):
        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register("taken_test", cls)

    with pytest.raises(ValueError, match="pass override=True to replace it"):

        class Second(_CPUBacked):
            @classmethod
            def register_accelerators(cls, accelerator_registry: Any) -> None:
                accelerator_registry.register("taken_test", cls)

    assert type(ACCELERATOR_REGISTRY.get("taken_test")) is First


def test_a_subclass_missing_the_api_is_refused_naming_what_it_lacks() -> None:
    """It raised a bare NotImplementedError from is_available (no message)."""

    import torchrig

    class Half(torchrig.Accelerator):
        @staticmethod
        def is_available() -> bool:
            return True

    for make in (torchrig.Rig, torchrig.Trainer):
        with pytest.raises(
            TypeError,
            match=r"^accelerator=Half\(\) does not define parse_devices, get_parallel_devices, auto_device_count; "
            r"a subclass of torchrig.Accelerator defines the static methods parse_devices, get_parallel_devices, "
            r"auto_device_count, is_available \(examples/custom_accelerator.py is a complete one\)$",
        ):
            make(accelerator=Half())
