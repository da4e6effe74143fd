"""The named registry: register/decorator/get/remove, listings, errors, entry-point discovery."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchrig import ACCELERATOR_REGISTRY, Accelerator, CPUAccelerator, TorchDeviceAccelerator
from torchrig.accelerators import AcceleratorRegistry
from torchrig.resolve import resolve

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def restore_global_registry() -> Iterator[None]:
    """Tests define accelerator classes that register themselves globally; undo that."""
    saved = (dict(ACCELERATOR_REGISTRY._entries), dict(ACCELERATOR_REGISTRY._shadowed))
    loaded = ACCELERATOR_REGISTRY._entry_points_loaded
    yield
    ACCELERATOR_REGISTRY._entries, ACCELERATOR_REGISTRY._shadowed = saved
    ACCELERATOR_REGISTRY._entry_points_loaded = loaded


def fresh(group: str = "torchrig.tests.none") -> AcceleratorRegistry:
    return AcceleratorRegistry(kind="accelerator", entry_point_group=group, hook="register_accelerators")


class Sim(Accelerator):
    """A CPU-backed accelerator with one init parameter."""

    def __init__(self, *, speed: int = 1) -> None:
        self.speed = speed

    @staticmethod
    def is_available() -> bool:
        return True


class OtherSim(Sim):
    pass


def test_register_call_get_with_init_params_and_overrides() -> None:
    reg = fresh()
    assert reg.register("sim", Sim, description="fast sim", speed=3) is Sim
    built = reg.get("sim")
    assert isinstance(built, Sim) and built.speed == 3
    assert reg.get("sim", speed=5).speed == 5  # overrides win over stored params
    assert reg.entry("sim").init_params == {"speed": 3}


def test_register_as_decorator_returns_the_class() -> None:
    reg = fresh()

    @reg.register("deco", description="decorated", speed=2)
    class Deco(Sim):
        pass

    assert isinstance(Deco, type) and issubclass(Deco, Sim)
    assert isinstance(reg.get("deco"), Deco) and reg.get("deco").speed == 2


def test_listing_names_sorted_with_descriptions() -> None:
    reg = fresh()
    reg.register("zeta", Sim, description="last one")
    reg.register("alpha", Sim, description="first one")
    assert reg.names() == ["alpha", "zeta"]
    assert list(reg) == ["alpha", "zeta"] and len(reg) == 2 and "alpha" in reg
    assert reg.describe() == {"alpha": "first one", "zeta": "last one"}
    text = str(reg)
    assert text.startswith("Registered accelerators:")
    assert "alpha" in text and "first one" in text and "last one" in text


def test_global_listing_describes_the_builtins() -> None:
    described = ACCELERATOR_REGISTRY.describe()
    assert {"cpu", "cuda", "mps", "xpu", "hpu", "npu", "xla", "tpu"} <= set(described)
    assert described["cpu"] == "The host CPU"
    assert "CUDA" in described["cuda"]


def test_remove_and_unknown_remove() -> None:
    reg = fresh()
    reg.register("sim", Sim)
    reg.remove("sim")
    assert "sim" not in reg
    with pytest.raises(ValueError, match=r"unknown accelerator 'sim'; known: "):
        reg.remove("sim")


def test_duplicate_name_is_an_error_that_mentions_override() -> None:
    reg = fresh()
    reg.register("sim", Sim)
    with pytest.raises(ValueError) as err:
        reg.register("sim", OtherSim)
    msg = str(err.value)
    assert "accelerator 'sim' is already registered by" in msg and "Sim" in msg
    assert "pass override=True to replace it with" in msg and "OtherSim" in msg
    assert type(reg.get("sim")) is Sim  # unchanged
    reg.register("sim", OtherSim, override=True)
    assert type(reg.get("sim")) is OtherSim


def test_registering_the_same_class_again_replaces_itself() -> None:
    # A re-run notebook cell defines the class again: that must not be a duplicate error.
    reg = fresh()
    reg.register("sim", Sim, speed=1)
    reg.register("sim", Sim, speed=4)
    assert reg.get("sim").speed == 4


def test_bad_name_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="the accelerator name must be a non-empty string, got ''"):
        fresh().register("", Sim)
    with pytest.raises(TypeError, match="got 3"):
        fresh().register(3, Sim)  # type: ignore[arg-type]


def test_unknown_name_lists_known_and_suggests_nearest() -> None:
    with pytest.raises(ValueError) as err:
        ACCELERATOR_REGISTRY.get("cdua")
    msg = str(err.value)
    assert msg.startswith("unknown accelerator 'cdua'; known: cpu, cuda,")
    assert msg.endswith("Did you mean 'cuda'?")
    with pytest.raises(ValueError) as err:
        ACCELERATOR_REGISTRY.get("qqqqqq")
    assert "Did you mean" not in str(err.value)


def test_user_entry_replaces_a_builtin_and_removing_it_brings_the_builtin_back() -> None:
    ACCELERATOR_REGISTRY.register("xpu", Sim, description="my xpu")
    assert type(ACCELERATOR_REGISTRY.get("xpu")) is Sim
    assert ACCELERATOR_REGISTRY.describe()["xpu"] == "my xpu"
    ACCELERATOR_REGISTRY.remove("xpu")
    back = ACCELERATOR_REGISTRY.get("xpu")
    assert isinstance(back, TorchDeviceAccelerator) and back.device_type == "xpu"
    assert ACCELERATOR_REGISTRY.entry("xpu").builtin


def test_available_accelerators_skips_broken_ones() -> None:
    class Broken(Sim):
        @staticmethod
        def is_available() -> bool:
            raise OSError("driver exploded")

    reg = fresh()
    reg.register("cpu", CPUAccelerator)
    reg.register("broken", Broken)
    reg.register("sim", Sim)
    assert reg.available_accelerators() == ["cpu", "sim"]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks a CPU-only machine")
def test_global_available_accelerators_is_cpu_here() -> None:
    assert ACCELERATOR_REGISTRY.available_accelerators() == ["cpu"]


# -- entry points: a real installed distribution (a dist-info directory) on sys.path ----------
PLUGIN = '''
import torch
from torchrig import Accelerator, CPUAccelerator


class PlainAccelerator(CPUAccelerator):
    """A plugin class that does not register itself."""


class HookAccelerator(CPUAccelerator):
    """A plugin class with the hook: it picks its own name."""

    @classmethod
    def register_accelerators(cls, registry):
        registry.register("plug_hook", cls, description="registered by its hook")


def register(registry):
    registry.register("plug_fn", CPUAccelerator, description="registered by a function")
'''

ENTRY_POINTS = """
[torchrig.accelerators]
plug_plain = rig_plugin_demo:PlainAccelerator
plug_hook_ep = rig_plugin_demo:HookAccelerator
plug_fn_ep = rig_plugin_demo:register
broken = rig_plugin_missing_module:Nothing
"""


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "rig_plugin_demo.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "rig_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rig-plugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "rig_plugin_demo", raising=False)
    return tmp_path


def test_entry_points_are_discovered_on_first_use(installed_plugin: Path, caplog: pytest.LogCaptureFixture) -> None:
    reg = fresh("torchrig.accelerators")
    assert reg._entries == {}  # nothing is read before first use
    with caplog.at_level(logging.WARNING, logger="torchrig.registry"):
        names = reg.names()
    assert {"plug_plain", "plug_hook", "plug_fn"} <= set(names)
    assert "plug_hook_ep" not in names  # a class with the hook chooses its own name
    assert "broken" not in names
    assert "could not load accelerator entry point 'broken'" in caplog.text
    assert reg.describe()["plug_plain"] == "A plugin class that does not register itself."
    assert reg.describe()["plug_fn"] == "registered by a function"
    assert type(reg.get("plug_plain")).__name__ == "PlainAccelerator"


def test_global_registry_selects_an_entry_point_accelerator_by_name(
    installed_plugin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ACCELERATOR_REGISTRY, "_entry_points_loaded", False)
    plan = resolve(accelerator="plug_plain", devices=1)
    assert type(plan.accelerator).__name__ == "PlainAccelerator"
    assert plan.accelerator.name() == "plug_plain"
    assert plan.devices == (torch.device("cpu"),)


def test_a_clashing_plugin_is_skipped_with_a_warning(installed_plugin: Path, caplog: pytest.LogCaptureFixture) -> None:
    reg = fresh("torchrig.accelerators")
    reg.register("plug_fn", Sim)  # the user's own entry comes first
    with caplog.at_level(logging.WARNING, logger="torchrig.registry"):
        names = reg.names()
    assert "plug_plain" in names
    assert type(reg.get("plug_fn")) is Sim
    assert "could not register accelerator entry point 'plug_fn_ep'" in caplog.text
    assert "override=True" in caplog.text
