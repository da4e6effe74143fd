"""The examples run as a user runs them, and docs/demo.md shows the diff the raw->Rig example makes."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
from types import ModuleType

import pytest

from conftest import PYTHON, ROOT, python_env
from torchrig.precision import supported_precisions

EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, str(EXAMPLES / name), *args], env=python_env(), capture_output=True, text=True, timeout=timeout
    )


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(100)
def test_raw_to_rig_trains_both_loops_to_a_similar_loss() -> None:
    done = run_example("raw_to_rig.py")
    assert done.returncode == 0, done.stderr[-3000:]
    raw = re.search(r"hand-written loop: final loss (\d+\.\d+) in", done.stdout)
    rig = re.search(r"Rig loop: +final loss (\d+\.\d+) in", done.stdout)
    assert raw and rig, done.stdout
    assert float(raw[1]) < 0.2 and float(rig[1]) < 0.2  # both learned the problem (chance: ln 4 = 1.39)
    assert "the two loops agree" in done.stdout


def test_the_diff_in_docs_is_the_diff_of_the_example() -> None:
    diff = load_example("raw_to_rig.py").loop_diff()
    assert diff.startswith("--- raw loop\n+++ Rig loop\n")
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-"]
    assert len(changed) <= 12, diff  # the promise: a few lines
    docs = (ROOT / "docs" / "demo.md").read_text()
    blocks = re.findall(r"```diff\n(.*?)```", docs, re.S)
    assert diff in blocks, "docs/demo.md is out of date: paste `python examples/raw_to_rig.py --diff` into it"


@pytest.mark.timeout(100)
def test_mixed_precision_lists_every_supported_precision_with_a_finite_loss() -> None:
    done = run_example("mixed_precision.py", "--accelerator", "cpu", "--steps", "20")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = dict(re.findall(r"^(\S+-(?:true|mixed))\s+(\S+)\s+\S+\s+\S+$", done.stdout, re.M))
    assert list(rows) == supported_precisions("cpu")
    assert all(math.isfinite(float(loss)) for loss in rows.values()), done.stdout
    losses = [float(loss) for loss in rows.values()]
    assert max(losses) - min(losses) < 0.5, done.stdout  # the same run in each precision: similar losses


@pytest.mark.timeout(100)
def test_mixed_precision_rejects_a_precision_the_device_lacks() -> None:
    done = run_example("mixed_precision.py", "--accelerator", "cpu", "--precisions", "fp8")
    assert done.returncode != 0
    assert "unknown precision='fp8'" in done.stderr


def test_examples_exist_where_the_docs_say() -> None:
    docs = (ROOT / "docs" / "demo.md").read_text()
    for name in re.findall(r"`examples/(\w+\.py)`", docs):
        assert (EXAMPLES / name).is_file(), name
