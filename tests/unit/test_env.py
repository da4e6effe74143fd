"""``torchrig env``: the JSON and table outputs, and that a failing probe never crashes it."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import torch

from conftest import PYTHON, python_env
from torchrig import envinfo
from torchrig.cli import main

pytestmark = pytest.mark.timeout(60)

CPU_ONLY_BUILD = not (torch.version.cuda or getattr(torch.version, "hip", None) or getattr(torch.version, "xpu", None))
SECTIONS = {"system", "torch", "torchrig", "accelerators", "distributed", "cluster", "precision", "packages"}


def run_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["env", "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def run_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps long reasons at 80 columns when piped
    assert main(["env"]) == 0
    return capsys.readouterr().out


def test_json_has_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    info = run_json(capsys)
    assert set(info) == SECTIONS
    assert info["system"]["python"].count(".") == 2 and info["system"]["platform"]
    assert info["torch"]["version"] == torch.__version__
    assert info["torchrig"]["version"] == __import__("torchrig").__version__
    cpu = info["accelerators"]["cpu"]
    assert cpu["available"] is True and cpu["device_count"] == 1
    assert cpu["supported_precisions"][0] == "32-true" and cpu["auto_precision"] == "32-true"
    assert {"cuda", "mps", "xpu", "xla", "tpu"} <= set(info["accelerators"])
    assert info["distributed"]["backends"]["gloo"] is True
    assert set(info["distributed"]["backends"]) == {"gloo", "nccl", "xccl", "mpi", "ucc"}
    assert info["precision"]["default"] == "32-true"
    assert "bf16-mixed" in info["precision"]["supported"]
    assert info["packages"]["rich"] and "lightning" in info["packages"]


@pytest.mark.skipif(not CPU_ONLY_BUILD or torch.accelerator.is_available(), reason="checks a CPU-only machine")
def test_json_on_this_cpu_machine(capsys: pytest.CaptureFixture[str]) -> None:
    info = run_json(capsys)
    assert info["torch"]["build"] == "CPU" and info["torch"]["current_accelerator"] is None
    assert info["torchrig"]["auto_accelerator"] == "cpu"
    assert info["precision"] == {
        "device_type": "cpu",
        "default": "32-true",
        "auto": "32-true",
        "supported": ["32-true", "64-true", "16-mixed", "16-true", "bf16-mixed", "bf16-true", "fp8-mixed"],
    }
    cuda = info["accelerators"]["cuda"]
    assert cuda["available"] is False
    assert cuda["reason"].startswith("this PyTorch build has no CUDA: torch ")
    assert info["accelerators"]["tpu"]["reason"].startswith("torch_xla is not installed")
    assert info["distributed"]["backends"]["nccl"] is False


def test_the_cpu_precisions_listed_are_the_ones_a_rig_accepts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchrig

    info = run_json(capsys)
    listed = info["accelerators"]["cpu"]["supported_precisions"]
    assert "fp8-mixed" in listed and info["accelerators"]["cpu"]["fp8_refused"] is None  # torchao is installed
    assert listed == info["precision"]["supported"]
    for precision in listed:  # each one is accepted, none falls back: fp8-mixed converts a layer to float8
        rig = torchrig.Rig(accelerator="cpu", precision=precision)
        model = rig.prepare(torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3))))
        assert (type(model.module[1]).__name__ == "Float8Linear") == (precision == "fp8-mixed"), precision

    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)  # torchao's float8 cannot be imported
    info = run_json(capsys)
    assert "fp8-mixed" not in info["accelerators"]["cpu"]["supported_precisions"]
    assert "fp8-mixed" not in info["precision"]["supported"]
    refused = info["accelerators"]["cpu"]["fp8_refused"]
    assert refused.startswith("ModuleNotFoundError: precision='fp8-mixed' needs torchao's float8 training"), refused
    with pytest.raises(ModuleNotFoundError, match=r"precision='fp8-mixed' needs torchao's float8 training"):
        torchrig.Rig(accelerator="cpu", precision="fp8-mixed")
    out = run_table(capsys, monkeypatch)
    assert "no fp8-mixed: ModuleNotFoundError: precision='fp8-mixed' needs torchao" in " ".join(out.split())


def test_precision_default_follows_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRIG_PRECISION", "bf16-mixed")
    assert run_json(capsys)["precision"]["default"] == "bf16-mixed"


@pytest.mark.skipif(not CPU_ONLY_BUILD, reason="checks the CPU-only build's reasons")
def test_table_mentions_cpu_and_why_cuda_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = run_table(capsys, monkeypatch)
    assert "torchrig env" in out and "accelerators" in out
    assert "│ cpu " in out and "The host CPU" in out
    assert "this PyTorch build has no CUDA: torch" in out
    assert "MPS needs macOS on Apple silicon" in out
    assert "gloo: yes" in out
    assert "packages: " in out and "rich " in out


def test_a_failing_probe_is_reported_not_fatal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom() -> dict[str, Any]:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(envinfo, "probe_torch", boom)
    monkeypatch.setattr(envinfo, "probe_distributed", boom)
    info = run_json(capsys)
    assert info["torch"] == {"error": "RuntimeError: driver exploded"}
    assert info["distributed"] == {"error": "RuntimeError: driver exploded"}
    assert info["accelerators"]["cpu"]["available"] is True  # the other sections still report
    out = run_table(capsys, monkeypatch)
    assert "error: RuntimeError: driver exploded" in out and "The host CPU" in out


def test_one_broken_accelerator_does_not_hide_the_others(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = envinfo.probe_accelerator

    def flaky(name: str) -> dict[str, Any]:
        if name == "mps":
            raise ImportError("plugin missing")
        return real(name)

    monkeypatch.setattr(envinfo, "probe_accelerator", flaky)
    info = run_json(capsys)
    assert info["accelerators"]["mps"] == {"error": "ImportError: plugin missing"}
    assert info["accelerators"]["cpu"]["available"] is True
    out = run_table(capsys, monkeypatch)
    assert "error: ImportError: plugin missing" in out


def test_every_section_failing_still_exits_zero(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for probe in SECTIONS:
        monkeypatch.setattr(envinfo, f"probe_{probe}", lambda: 1 / 0)
    info = run_json(capsys)
    assert info == {key: {"error": "ZeroDivisionError: division by zero"} for key in SECTIONS}
    assert "error: ZeroDivisionError" in run_table(capsys, monkeypatch)


def test_missing_packages_are_named(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envinfo, "OPTIONAL_PACKAGES", {"rich": "rich", "nosuchpkg_xyz": "nosuchpkg-xyz"})
    info = run_json(capsys)
    assert info["packages"]["nosuchpkg_xyz"] is None and info["packages"]["rich"]
    assert "not installed: nosuchpkg_xyz" in run_table(capsys, monkeypatch)


def test_console_script_runs() -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "torchrig.cli", "env", "--json"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(json.loads(proc.stdout)) == SECTIONS


def test_without_rich_it_falls_back_to_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "rich.console", None)  # makes `import rich.console` fail
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    first, rest = out.split("\n", 1)
    assert first.startswith("(tables need rich, which failed to import: ")
    assert set(json.loads(rest)) == SECTIONS
