"""examples/custom_accelerator.py: runs end to end, and its class is importable and selectable."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from conftest import PYTHON, ROOT, python_env
from torchrig import ACCELERATOR_REGISTRY, Rig

EXAMPLE = ROOT / "examples" / "custom_accelerator.py"


@pytest.fixture
def example() -> Iterator[ModuleType]:
    saved = dict(ACCELERATOR_REGISTRY._entries)
    spec = importlib.util.spec_from_file_location("custom_accelerator_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defining the class registers "xpu_sim"
    yield module
    ACCELERATOR_REGISTRY._entries = saved


@pytest.mark.slow  # the example in new interpreters: 3.0 s of CPU (measured on the shared 2-core machine)
@pytest.mark.timeout(60)
def test_example_runs_and_trains_on_both_paths() -> None:
    proc = subprocess.run(
        [PYTHON, str(EXAMPLE), "--steps", "15"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for label in ("instance", "name"):
        line = next(x for x in out.splitlines() if x.startswith(f"by {label}: "))
        assert "accelerator=xpu_sim class=XPUAccelerator device=cpu precision=32-true steps=15" in line
        first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", line).groups())  # type: ignore[union-attr]
        assert last < first / 10, line  # it really trained
        assert "stats=['process_rss_bytes', 'simulated']" in line


@pytest.mark.timeout(10)
def test_class_is_importable_and_selectable_by_name(example: ModuleType) -> None:
    cls = example.XPUAccelerator
    assert ACCELERATOR_REGISTRY.describe()["xpu_sim"].startswith("Simulated XPU (the host CPU)")
    assert type(ACCELERATOR_REGISTRY.get("xpu_sim")) is cls
    assert type(ACCELERATOR_REGISTRY.get("xpu")).__name__ == "TorchDeviceAccelerator"  # built-in untouched
    rig = Rig(accelerator="xpu_sim", devices=1)
    assert type(rig.accelerator) is cls and rig.device == torch.device("cpu")
    assert cls.parse_devices("auto") == [0] and cls.get_parallel_devices([0]) == [torch.device("cpu")]


@pytest.mark.timeout(10)
def test_example_devices_errors_use_torchrig_messages(example: ModuleType) -> None:
    with pytest.raises(ValueError) as err:
        Rig(accelerator=example.XPUAccelerator(), devices=[1])
    assert str(err.value) == "devices=[1] asks for xpu_sim:1, but this machine has 1 xpu_sim device: [0]"
