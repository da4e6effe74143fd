"""The examples of docs/data.md run as they are: each fits, stops inside the epoch, resumes, and
checks the batches against the fit never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_helpers import docs_example

from conftest import run_example

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    "heading",
    [
        "## Map-style datasets",
        "## Iterable datasets with a position (`state_dict`/`load_state_dict`)",
        "## Iterable datasets without a position",
    ],
)
def test_the_examples_of_docs_data_run(heading: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_example(docs_example(heading, "data.md"), f"docs/data.md {heading}", tmp_path, capsys)
