"""README.md as written: its Python quickstarts run and print what the text says, its diff is
what the command it names prints, and it points only at files that exist in a clone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, python_env

README = (ROOT / "README.md").read_text()


def run_block(code: str, cwd: Path) -> str:
    done = subprocess.run([PYTHON, "-c", code], cwd=cwd, env=python_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def block(heading: str) -> str:
    """The first python block after the README heading ``heading``."""
    rest = README[README.index(f"## {heading}\n") :]
    return re.search(r"```python\n(.*?)```", rest, re.S).group(1)  # type: ignore[union-attr]


@pytest.mark.timeout(160)
def test_the_rig_quickstart_trains(tmp_path: Path) -> None:
    out = run_block(block("Quickstart: Rig (your loop, any hardware)"), tmp_path)
    losses = [float(m) for m in re.findall(r"epoch \d: loss (\d+\.\d+) on cpu", out)]
    assert len(losses) == 5, out
    assert losses[0] > 1.5 and losses[-1] < 0.5, out  # what the comment in the block says


@pytest.mark.timeout(160)
def test_the_trainer_quickstart_trains_then_resumes_in_a_new_run(tmp_path: Path) -> None:
    out = run_block(block("Quickstart: Trainer"), tmp_path)
    assert re.search(r"^run 1: 24 steps, train_loss ", out, re.M), out
    assert re.search(r"^run 2: 48 steps, train_loss ", out, re.M), out
    resumed = r"resumed from .*version_0/checkpoints/last -> epoch=\S*-step=24: continues with epoch 3/5, step 24"
    assert re.search(resumed, out), out
    first, second = (float(m) for m in re.findall(r"^run \d: \d+ steps, train_loss (\S+)", out, re.M))
    assert second < first, out  # "with a lower loss"
    assert (tmp_path / "torchrig_logs" / "version_0" / "metrics.csv").is_file()
    assert (tmp_path / "torchrig_logs" / "version_1" / "checkpoints" / "last").is_dir()


@pytest.mark.timeout(60)
def test_the_readme_diff_is_what_raw_to_rig_prints() -> None:
    shown = re.search(r"```diff\n(.*?)```", README, re.S).group(1)  # type: ignore[union-attr]
    done = subprocess.run(
        [PYTHON, str(ROOT / "examples" / "raw_to_rig.py"), "--diff"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown


def test_every_link_and_path_the_readme_names_exists_in_a_clone() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links, "the README links to the docs"
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), link
    assert "../shared" not in README  # not in a clone


def test_torchrig_cli_as_the_readme_writes_it() -> None:
    assert "torchrig.cli.CLI(MyModule, MyDataModule)" in README
    code = "import torchrig; from torchrig.trainer.cli import CLI; assert torchrig.cli.CLI is CLI"
    done = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
