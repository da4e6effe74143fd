"""Shared fixtures: every test starts from a known seed and leaves no process group behind."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

from torchrig import ACCELERATOR_REGISTRY, STRATEGY_REGISTRY  # noqa: E402

_SESSION_ENVIRON = dict(os.environ)
_RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_BUILTIN_ENTRIES = [(r, dict(r._entries)) for r in (ACCELERATOR_REGISTRY, STRATEGY_REGISTRY)]


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in (
        "TORCHRIG_ACCELERATOR",
        "TORCHRIG_DEVICES",
        "TORCHRIG_STRATEGY",
        "TORCHRIG_PRECISION",
        "TORCHRIG_NUM_NODES",
    ):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    # Registries are process-global, and defining or importing an accelerator/strategy class
    # registers it (even while test modules are collected): every test starts from the built-ins.
    _restore_registries()
    with process_group_undone():
        yield
    _restore_registries()


@contextlib.contextmanager
def process_group_undone() -> Iterator[None]:
    """Destroy a process group made inside the block and put the rank variables back.

    A Rig with strategy="fsdp"/"ddp" and one device joins a one-process group in this process and
    sets RANK/WORLD_SIZE...; a later test in the same session would find both (torchrig.plan()
    refuses to run inside a real group, a Rig takes the world size from WORLD_SIZE). A group made
    by a module-scoped fixture, before the test, is left to that fixture.
    """
    import torch.distributed as dist

    saved, had_group = {name: os.environ.get(name) for name in _RANK_VARS}, dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True, scope="module")
def _module_process_group_undone() -> Iterator[None]:
    """The same for a group made by a module-scoped fixture: destroyed when the module's tests end."""
    with process_group_undone():
        yield


def _restore_registries() -> None:
    for registry, entries in _BUILTIN_ENTRIES:
        registry._entries.clear()
        registry._entries.update(entries)


def python_env() -> dict[str, str]:
    """The environment for subprocesses: this interpreter, torchrig importable, one thread.

    A Rig that starts the other ranks from this process (FSDP or DDP in one process, in a test or
    a module-scoped fixture) leaves its rank variables in ``os.environ`` for code that reads them;
    a subprocess that inherited them would take itself for a rank of that finished run. They
    are passed on only as the session started with them.
    """
    env = dict(os.environ)
    for var in _RANK_VARS:
        if var in _SESSION_ENVIRON:
            env[var] = _SESSION_ENVIRON[var]
        else:
            env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable


def printed_json(text: str) -> list[Any]:
    """The JSON objects printed as lines of ``text`` (a line that starts with ``{``), in order.

    Two ranks printing at the same moment to one pipe can run their lines together: the
    subprocesses run unbuffered (``PYTHONUNBUFFERED``), where a line's text and its end are two
    writes, so ``{a}{b}`` then two line ends is read as two objects, as printed.
    """
    decoder = json.JSONDecoder()
    objects: list[Any] = []
    for line in text.splitlines():
        at = 0
        while line.startswith("{", at):
            value, at = decoder.raw_decode(line, at)
            objects.append(value)
    return objects


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests under tests/gpu are marked ``gpu`` and skipped cleanly without an accelerator; tests
    that start real processes (``distributed``) are also ``slow``: ``pytest -m "not slow"`` is
    the quick part of the suite (README), ``pytest`` (and .ci/run) everything."""
    has_accelerator = torch.accelerator.is_available()
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not has_accelerator:
                item.add_marker(pytest.mark.skip(reason="no accelerator (torch.accelerator.is_available() is False)"))


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh folder on fsspec's in-memory file system (``memory://...``), removed afterwards."""
    import uuid

    fsspec = pytest.importorskip("fsspec")
    name = f"/torchrig-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def trained_mlp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP and its AdamW after one step (its moments exist), from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def run_example(code: str, name: str, folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run a docs example as written, in this process, in ``folder``: what it printed.

    In-process, not ``python -c``: a new interpreter pays about 1.6 s of CPU importing torch
    before the example's first line, and proves nothing more about the example."""
    import contextlib

    capsys.readouterr()
    with contextlib.chdir(folder):
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    return str(capsys.readouterr().out)
