"""A device type torchrig has never heard of (PrivateUse1) works with no torchrig code.

Renaming PrivateUse1 is process-global and irreversible, so everything runs in one subprocess
that reports what it saw as JSON; the tests below assert on that report. The backend is a plain
Python module registered with ``torch._register_device_module``: PyTorch then knows the device
type, ``torch.accelerator`` reports it, and torchrig selects, parses and reports it; but with no
C++ kernels or allocator no tensor can be created on it, and torchrig says so in words.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from conftest import PYTHON, python_env

pytestmark = pytest.mark.timeout(90)

CHILD = r"""
import json, sys, types

import torch

import torchrig
from torchrig import ACCELERATOR_REGISTRY
from torchrig.accelerators import TorchDeviceAccelerator

out = {"known_before": "mydev" in ACCELERATOR_REGISTRY}

# A backend that exists only in Python: a device module and a renamed PrivateUse1 key.
mod = types.ModuleType("torch_mydev")
state = {"current": 0, "calls": []}
mod.is_available = lambda: True
mod.device_count = lambda: 2
mod.current_device = lambda: state["current"]
def set_device(i):
    state["calls"].append(i)
    state["current"] = int(i)
mod.set_device = set_device
mod.memory_allocated = lambda device=None: 1234
mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
mod._is_in_bad_fork = lambda: False
mod.manual_seed_all = lambda seed: None
torch.utils.rename_privateuse1_backend("mydev")
torch._register_device_module("mydev", mod)

def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as err:
        out[key] = {"raised": type(err).__name__, "message": str(err)}

from torchrig.resolve import resolve
plan = resolve(accelerator="mydev", devices=[1])
acc = plan.accelerator
out["plan_devices"] = [str(d) for d in plan.devices]
out["plan_class"] = type(acc).__name__
out["plan_name"] = acc.name()
out["plan_precision"] = plan.precision.name
out["known_after"] = "mydev" in ACCELERATOR_REGISTRY
out["auto_name"] = resolve(accelerator="auto", devices=1).accelerator.name()
out["gpu_name"] = resolve(accelerator="gpu", devices=1).accelerator.name()
out["parse_all"] = acc.parse_devices(-1)
out["parse_auto_devices"] = [str(d) for d in acc.get_parallel_devices("auto")]
out["parse_str"] = acc.parse_devices("1,")
attempt("parse_out_of_range", lambda: acc.parse_devices([3]))
from torchrig.precision import supported_precisions, auto_precision
attempt("supported_precisions", lambda: supported_precisions("mydev"))
attempt("auto_precision", lambda: auto_precision("mydev"))
attempt("bf16_plan", lambda: resolve(accelerator="mydev", devices=1, precision="bf16-mixed").precision.name)
attempt("stats", lambda: acc.get_device_stats("mydev:0"))
# Current-device helpers: torch.accelerator needs the C++ device guard; torchrig falls back.
attempt("torch_accelerator_index", lambda: torch.accelerator.current_device_index())
attempt("current_before", torchrig.current_device_index)
attempt("set_1", lambda: torchrig.set_device_index(1))
attempt("current_after_set", torchrig.current_device_index)
def ctx():
    with torchrig.device_index(0) as i:
        inside = torchrig.current_device_index()
    return [i, inside, torchrig.current_device_index()]
attempt("context", ctx)
attempt("set_out_of_range", lambda: torchrig.set_device_index(5))
out["set_device_calls"] = state["calls"]
# The limit: no kernels, no allocator.
attempt("ones", lambda: torch.ones(1, device="mydev").tolist())
attempt("rig", lambda: repr(torchrig.Rig(accelerator="mydev", devices=1)))
from torchrig.envinfo import gather
info = gather()
out["env_mydev"] = info["accelerators"].get("mydev")
out["env_current"] = info["torch"].get("current_accelerator")
import io
from rich.console import Console
from torchrig.commands.env import render
buf = io.StringIO()
render(info, Console(file=buf, width=200))
out["env_table_has_mydev"] = "mydev" in buf.getvalue()
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    proc = subprocess.run(
        [PYTHON, "-c", CHILD], env=python_env(), capture_output=True, text=True, timeout=80, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


def test_unknown_device_type_is_selected_by_name_with_no_torchrig_code(report: dict[str, Any]) -> None:
    assert report["known_before"] is False  # torchrig had never heard of "mydev"
    assert report["known_after"] is True
    assert report["plan_class"] == "TorchDeviceAccelerator" and report["plan_name"] == "mydev"
    assert report["plan_devices"] == ["mydev:1"]
    assert report["plan_precision"] == "32-true"


def test_auto_and_gpu_pick_the_registered_backend(report: dict[str, Any]) -> None:
    assert report["auto_name"] == "mydev"  # torch.accelerator.current_accelerator() reports it
    assert report["gpu_name"] == "mydev"


def test_devices_parse_against_the_backend_device_count(report: dict[str, Any]) -> None:
    assert report["parse_all"] == [0, 1]
    assert report["parse_auto_devices"] == ["mydev:0", "mydev:1"]
    assert report["parse_str"] == [1]
    assert report["parse_out_of_range"] == {
        "raised": "ValueError",
        "message": "devices=[3] asks for mydev:3, but this machine has 2 mydev devices: [0, 1]",
    }


def test_precision_probing_does_not_blow_up(report: dict[str, Any]) -> None:
    # Half dtypes cannot be allocated there, so they are not offered; asking for one says why.
    assert report["supported_precisions"] == ["32-true", "64-true"]
    assert report["auto_precision"] == "32-true"
    assert report["bf16_plan"] == {
        "raised": "ValueError",
        "message": "precision='bf16-mixed' is not supported on mydev; mydev supports: 32-true, 64-true",
    }


def test_device_stats_fall_back_to_the_device_module(report: dict[str, Any]) -> None:
    # torch.accelerator.memory_allocated needs a C++ DeviceAllocator; the module's function answers.
    assert report["stats"] == {"allocated_bytes": 1234}


def test_current_device_helpers_fall_back_to_the_device_module(report: dict[str, Any]) -> None:
    # The limit: torch.accelerator's index functions need the backend's C++ device guard...
    assert report["torch_accelerator_index"] == {
        "raised": "RuntimeError",
        "message": "PyTorch is not linked with support for mydev devices",
    }
    # ...so torchrig's helpers use the module's current_device/set_device, which PyTorch's
    # PrivateUse1 documentation asks every backend module to provide.
    assert report["current_before"] == 0
    assert report["set_1"] is None and report["current_after_set"] == 1
    assert report["context"] == [0, 0, 1]  # inside the block 0 is current; after it, 1 again
    assert report["set_out_of_range"]["message"] == (
        "devices=[5] asks for mydev:5, but this machine has 2 mydev devices: [0, 1]"
    )
    assert report["set_device_calls"] == [1, 0, 1, 0]  # set 1, enter 0, restore 1, the Rig's setup 0


def test_no_tensor_without_a_cpp_backend_and_rig_says_why(report: dict[str, Any]) -> None:
    assert report["ones"]["raised"] == "NotImplementedError"
    assert (
        "Could not run 'aten::empty.memory_format' with arguments from the 'mydev' backend"
        in (report["ones"]["message"])
    )
    rig = report["rig"]
    assert rig["raised"] == "RuntimeError"
    assert rig["message"].startswith(
        "the 'mydev' backend is registered with PyTorch, but it cannot allocate a tensor on mydev:0 "
        "(Could not run 'aten::empty.memory_format' with arguments from the 'mydev' backend)"
    )
    assert "has no kernels and no allocator" in rig["message"]
    assert rig["message"].endswith("Import the backend's package, or use accelerator='cpu'")


def test_torchrig_env_lists_the_backend(report: dict[str, Any]) -> None:
    env = report["env_mydev"]
    assert env["available"] is True and env["device_count"] == 2
    assert env["class"] == "torchrig.accelerators.torch_device.TorchDeviceAccelerator"
    assert env["can_allocate"].startswith("no: Could not run 'aten::empty.memory_format'")
    assert env["supported_precisions"] == ["32-true", "64-true"]
    assert env["bf16_supported"] is False and env["fp16_supported"] is False
    assert report["env_current"] == "mydev"
    assert report["env_table_has_mydev"] is True
