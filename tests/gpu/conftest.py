"""GPU tests: marked ``gpu`` and skipped cleanly when no accelerator is present."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has = torch.accelerator.is_available()
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not has:
                item.add_marker(pytest.mark.skip(reason="no accelerator (torch.accelerator.is_available() is False)"))
