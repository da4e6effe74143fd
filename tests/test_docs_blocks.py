"""Every code block of README.md and docs/*.md that a user pastes: it parses, and the
self-contained ones that no other test runs run as written (the rest are run, with what they
print, by test_readme.py, test_docs_migrating.py, trainer/test_trainer_tools_docs.py,
trainer/test_docs_data.py and the tests that name their docs section)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_example
from test_readme import block as readme_block
from trainer.test_trainer_tools_docs import blocks

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(kind: str) -> list[tuple[str, str]]:
    return [
        (f"{page.name}:{code.splitlines()[0][:40]}", code) for page in PAGES for code in blocks(page.read_text(), kind)
    ]


@pytest.mark.parametrize(("where", "code"), _blocks("python"), ids=[w for w, _ in _blocks("python")])
def test_every_python_block_parses(where: str, code: str) -> None:
    ast.parse(code, filename=where)


@pytest.mark.parametrize(("where", "text"), _blocks("yaml"), ids=[w for w, _ in _blocks("yaml")])
def test_every_yaml_block_parses(where: str, text: str) -> None:
    assert isinstance(yaml.safe_load(text), dict), where


def test_the_trainer_guide_quickstart_is_the_readme_one_that_test_readme_runs() -> None:
    (guide,) = blocks(_section(ROOT / "docs" / "trainer.md", "## Quickstart"), "python")
    assert guide == readme_block("Quickstart: Trainer")


def _section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


# (page, heading, first line): the one-process blocks that stand alone and no other test runs.
STANDALONE = [
    ("rig.md", "## Quickstart", "import torch, torch.nn.functional as F, torchrig"),
    ("trainer.md", "## Callbacks", "from torchrig.trainer import Callback, EventSchedule"),
    ("distributed.md", "## Strategies", "from datetime import timedelta"),
    ("trainer_tools.md", "## Loggers", "import torchrig"),
    (
        "trainer_tools.md",
        "## Throughput and MFU: `torchrig.ThroughputMonitor`",
        "from torchrig import ThroughputMonitor, Trainer",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("page", "heading", "first"), STANDALONE, ids=[f"{p} {h}" for p, h, _ in STANDALONE])
def test_the_standalone_blocks_run_as_written(
    page: str, heading: str, first: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = [c for c in blocks(_section(ROOT / "docs" / page, heading), "python") if c.startswith(first + "\n")]
    assert len(found) == 1, f"docs/{page} {heading}: no single python block starting {first!r}"
    run_example(found[0], f"docs/{page} {heading}", tmp_path, capsys)


@pytest.mark.timeout(60)
def test_the_import_example_of_the_checkpoint_guide_prints_what_it_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/checkpoints.md's `torchrig checkpoint import` session, run on the Lightning 2.6.6
    checkpoint in tests/data/peers (the guide's home directory is this test's)."""
    import shutil

    from torchrig.cli import main

    text = _section(ROOT / "docs" / "checkpoints.md", "## Importing a Lightning or Accelerate checkpoint")
    command, *shown = blocks(text, "")[0].splitlines()
    assert command == "$ torchrig checkpoint import lightning.ckpt ckpt/imported"
    shutil.copy(ROOT / "tests" / "data" / "peers" / "lightning.ckpt", tmp_path / "lightning.ckpt")
    monkeypatch.chdir(tmp_path)
    assert main(command.split()[2:]) == 0
    assert capsys.readouterr().out.replace(str(tmp_path), "/home/me").splitlines() == shown


def test_the_mismatch_message_of_the_checkpoint_guide_is_the_one_raised(tmp_path: Path) -> None:
    from torch import nn

    import torchrig

    text = _section(ROOT / "docs" / "checkpoints.md", "## Guarantees")
    shown = next(b for b in blocks(text, "") if b.startswith("checkpoint entry 'model' does not match"))
    rig = torchrig.Rig(accelerator="cpu")
    rig.save(tmp_path / "ck", {"model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))})
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(torchrig.CheckpointError) as refused:
        rig.load(tmp_path / "ck", {"model": other})
    assert str(refused.value) + "\n" == shown
