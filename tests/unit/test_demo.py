"""``torchrig demo`` and ``torchrig plot``: data, model, learning-curve PNG, the commands end to end."""

from __future__ import annotations

import csv
import importlib.util
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

import torchrig
from conftest import PYTHON, python_env
from torchrig import cli
from torchrig.commands.demo import _devices
from torchrig.demo import INSTALL_HINT, MissingExtraError, require_extras
from torchrig.demo.model import DigitsCNN, cosine_factor
from torchrig.demo.plot import PNG_NAME, epoch_curves, plot_learning_curves
from torchrig.demo.run import latest_run

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def write_metrics(path: Path, epochs: int = 4) -> None:
    """A metrics.csv shaped as the CSVLogger writes it: step rows, epoch rows, a test row."""
    path.mkdir(parents=True, exist_ok=True)
    names = ["step", "epoch", "train_loss_step", "val_loss", "val_acc", "train_loss_epoch", "train_acc", "test_acc"]
    with (path / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names, restval="")
        writer.writeheader()
        for e in range(epochs):
            step = 10 * (e + 1)
            writer.writerow({"step": step - 5, "epoch": e, "train_loss_step": 9.0})  # ignored: epoch means win
            writer.writerow({"step": step, "epoch": e, "val_loss": 1.0 / (e + 1), "val_acc": 0.5 + 0.1 * e})
            writer.writerow({"step": step, "epoch": e, "train_loss_epoch": 2.0 / (e + 1), "train_acc": 0.6 + 0.1 * e})
        writer.writerow({"step": 10 * epochs, "epoch": epochs, "test_acc": 0.97})


# -- data and model --------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_splits_are_fixed_stratified_disjoint_and_normalised_by_train_only() -> None:
    from torchrig.demo.data import load_digit_splits

    a, b = load_digit_splits(), load_digit_splits()
    assert (len(a.train), len(a.val), len(a.test)) == (1257, 180, 360)
    assert torch.equal(a.test.tensors[0], b.test.tensors[0])  # the same held-out images every time
    train_x = a.train.tensors[0]
    assert train_x.shape[1:] == (1, 8, 8) and train_x.dtype == torch.float32
    assert abs(train_x.mean().item()) < 1e-4 and abs(train_x.std().item() - 1) < 1e-4
    assert abs(a.test.tensors[0].mean().item()) > 1e-4  # test pixels did not set the statistics
    assert a.test.tensors[1].bincount().tolist() == [36, 36, 35, 37, 36, 37, 36, 36, 35, 36]
    flat = [x.flatten() for part in (a.train, a.val, a.test) for x in part.tensors[0]]
    assert len(flat) == 1797
    other = load_digit_splits(split_seed=1)
    assert not torch.equal(a.test.tensors[0], other.test.tensors[0])


def test_split_fractions_are_checked() -> None:
    from torchrig.demo.data import load_digit_splits

    with pytest.raises(ValueError, match=r"val_fraction=0.5 and test_fraction=0.6 .* \(sum < 1\)"):
        load_digit_splits(val_fraction=0.5, test_fraction=0.6)


def test_datamodule_needs_setup_and_a_positive_batch_size() -> None:
    from torchrig.demo.data import DigitsDataModule

    with pytest.raises(ValueError, match=r"batch_size=0 must be an int >= 1 \(default 64\)"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(RuntimeError, match=r"setup\(stage\) must run before"):
        DigitsDataModule().train_dataloader()


def test_model_shapes_and_schedule() -> None:
    model = DigitsCNN(width=4)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    with pytest.raises(ValueError, match=r"width=0 must be an int >= 1 \(default 16\)"):
        DigitsCNN(width=0)
    assert cosine_factor(0, 10) == 1.0
    assert cosine_factor(5, 10) == pytest.approx(0.5)
    assert cosine_factor(10, 10) == pytest.approx(0.0, abs=1e-12)
    assert cosine_factor(15, 10) == pytest.approx(0.0, abs=1e-12)  # past the end it stays at the floor


def test_a_checkpoint_counts_the_demo_models_parameters_and_buffers_apart(tmp_path: Path) -> None:
    """docs/checkpoints.md and docs/demo.md: the demo's model has 14,538 parameters and 163 buffer
    values (BatchNorm's running statistics and batch counters), which meta.json counts apart."""
    model = DigitsCNN()
    assert sum(p.numel() for p in model.parameters()) == 14_538
    path = torchrig.Rig(accelerator="cpu").save(tmp_path / "ck", {"model": model}, link=None)
    info = torchrig.checkpoint.describe(path)
    assert (info["parameters"], info["buffers"]) == (14_538, 163)


def test_devices_option_parses_counts_and_lists() -> None:
    assert _devices("2") == 2 and _devices("-1") == -1
    assert _devices("0,1") == "0,1" and _devices("auto") == "auto"


# -- the optional extra ----------------------------------------------------------------------
def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    wanted = r"needs scikit-learn, which is not installed.*pip install scikit-learn matplotlib"
    with pytest.raises(MissingExtraError, match=wanted):
        require_extras()
    assert INSTALL_HINT == "pip install scikit-learn matplotlib (or, in a clone of torchrig, pip install -e '.[demo]')"


def test_demo_command_without_the_extra_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = importlib.util.find_spec
    missing = {"sklearn", "matplotlib"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    assert cli.main(["demo", "--root-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scikit-learn and matplotlib, which are not installed" in err
    assert "pip install scikit-learn matplotlib (or, in a clone of torchrig, pip install -e '.[demo]')" in err
    assert not any(tmp_path.iterdir())  # nothing was started


# -- the plot --------------------------------------------------------------------------------
def test_epoch_curves_prefer_epoch_means_and_average_step_values() -> None:
    rows = [
        {"step": 1, "epoch": 0, "loss": 4.0},
        {"step": 2, "epoch": 0, "loss": 2.0},
        {"step": 3, "epoch": 1, "loss": 1.0},
        {"step": 3, "epoch": 1, "val_acc": 0.9},
        {"step": 3, "val_loss": 5.0},  # no epoch: not on the curve
    ]
    assert epoch_curves(rows) == {"train_loss": {0: 3.0, 1: 1.0}, "val_acc": {1: 0.9}}
    rows.append({"step": 3, "epoch": 1, "train_loss_epoch": 0.5})
    assert epoch_curves(rows)["train_loss"] == {1: 0.5}


@pytest.mark.timeout(30)
def test_plot_renders_a_png_from_a_synthetic_metrics_csv(tmp_path: Path) -> None:
    write_metrics(tmp_path / "run")
    path = plot_learning_curves(tmp_path / "run")
    assert path == tmp_path / "run" / PNG_NAME
    assert png_size(path) == (1000, 400)


@pytest.mark.timeout(30)
def test_plot_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path / "run")
    out = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(tmp_path / "run"), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert png_size(out) == (1000, 400)

    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"torchrig plot: no metrics.csv in {tmp_path}" in err

    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "metrics.csv").write_text("step,epoch,lr\n1,0,0.1\n")
    assert cli.main(["plot", str(tmp_path / "odd")]) == 2
    err = capsys.readouterr().err
    assert "has no per-epoch loss or accuracy to plot; it has the columns ['lr']" in err
    assert not (tmp_path / "odd" / PNG_NAME).exists()


@pytest.mark.timeout(30)
def test_plot_command_takes_the_metrics_csv_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path / "run")
    assert cli.main(["plot", str(tmp_path / "run" / "metrics.csv")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'run' / PNG_NAME}"
    assert png_size(tmp_path / "run" / PNG_NAME) == (1000, 400)
    (tmp_path / "notes.txt").write_text("x")  # a file that is no run: a message, not a traceback
    assert cli.main(["plot", str(tmp_path / "notes.txt" / "deeper")]) == 2
    assert "torchrig plot: no metrics.csv in" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_plot_writes_where_it_says_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-o NAME without a suffix wrote NAME.png and printed 'wrote NAME'; -o FOLDER did the same."""
    write_metrics(tmp_path / "run")
    folder = tmp_path / "plots ü"
    folder.mkdir()
    for output, written in ((folder, folder / PNG_NAME), (tmp_path / "curves", tmp_path / "curves")):
        assert cli.main(["plot", str(tmp_path / "run"), "-o", str(output)]) == 0
        assert capsys.readouterr().out == f"wrote {written}\n"
        assert png_size(written) == (1000, 400)
    assert not (tmp_path / "curves.png").exists() and not (tmp_path / "plots ü.png").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("content", "error"),
    [
        (bytes(range(128, 256)), "'utf-8' codec can't decode byte 0x80 in position 0"),
        (b"step,epoch,train_loss\n1,0,abc\n", "could not convert string to float: 'abc'"),
    ],
    ids=["not-text", "not-a-number"],
)
def test_plot_of_a_file_that_is_no_metrics_csv_names_it(
    content: bytes, error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "metrics.csv").write_bytes(content)
    assert cli.main(["plot", str(tmp_path)]) == 2
    expected = f"torchrig plot: {tmp_path / 'metrics.csv'} is not a metrics.csv that a CSVLogger wrote: {error}"
    assert capsys.readouterr().err.startswith(expected)
    assert not (tmp_path / PNG_NAME).exists()


def test_torchrig_cli_is_reachable_as_the_readme_writes_it() -> None:
    code = "import torchrig; from torchrig.trainer.cli import CLI; assert torchrig.cli.CLI is CLI; print('ok')"
    done = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
    with pytest.raises(AttributeError, match="module 'torchrig' has no attribute 'nothing'"):
        _ = torchrig.nothing  # type: ignore[attr-defined]


def test_latest_run_is_the_newest_with_a_checkpoint(tmp_path: Path) -> None:
    assert latest_run(tmp_path) is None
    for version, with_ckpt in ((0, True), (2, True), (10, True), (11, False)):
        run = tmp_path / "digits" / f"version_{version}"
        run.mkdir(parents=True)
        if with_ckpt:
            (run / "checkpoints" / "last").mkdir(parents=True)
    assert latest_run(tmp_path) == tmp_path / "digits" / "version_10"  # numeric, not text, order


# -- the demo end to end ---------------------------------------------------------------------
def run_demo_command(*args: str, cwd: Path, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "torchrig.cli", "demo", *args],
        cwd=cwd,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def summary(stdout: str) -> dict[str, str]:
    """The ``name: value`` lines the demo prints at the end."""
    return {m[1].strip(): m[2].strip() for m in re.finditer(r"^ *([a-z ]+):\s+(.*)$", stdout, re.M)}


@pytest.mark.slow  # a new interpreter training the demo: 5.3 s of CPU (measured on the shared 2-core machine)
@pytest.mark.timeout(120)
def test_demo_end_to_end_in_a_subprocess(tmp_path: Path) -> None:
    done = run_demo_command("--max-epochs", "2", "--accelerator", "cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = summary(done.stdout)
    run_dir = Path("runs/demo/digits/version_0")
    assert out["device"] == "cpu (1 process)"
    assert out["precision"] == "32-true"
    assert re.fullmatch(r"\d+\.\d\d% \(test loss \d\.\d{4}, 360 held-out images\)", out["test accuracy"])
    assert re.fullmatch(r"\d+\.\d s since the command started \(2 epochs trained in \d+\.\d s\)", out["time"])
    assert out["run directory"] == str(run_dir)
    assert "Epoch 1/1" in done.stdout and "Test:" in done.stdout  # the progress bar's plain lines

    run_dir = tmp_path / run_dir
    assert (run_dir / "checkpoints" / "last" / "meta.json").exists()
    assert png_size(run_dir / PNG_NAME) == (1000, 400)
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    val_epochs = [r["epoch"] for r in rows if r.get("val_acc")]
    assert val_epochs == ["0", "1"]  # validated each epoch
    assert any(r.get("test_acc") for r in rows)


@pytest.mark.timeout(120)
def test_demo_resume_continues_the_previous_run_in_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "root")
    common = ["demo", "--root-dir", root, "--accelerator", "cpu"]
    assert cli.main([*common, "--resume"]) == 2
    assert "--resume continues the newest run under" in capsys.readouterr().err

    threads = torch.get_num_threads()
    assert cli.main([*common, "--max-epochs", "1"]) == 0
    assert torch.get_num_threads() == threads  # the demo's one-thread setting does not leak
    capsys.readouterr()
    assert cli.main([*common, "--max-epochs", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out and "Epoch 0/1" not in out
    assert "(resumed: epoch 1 trained in" in out  # counted from 0, as the bar and the checkpoint names
    run_dir = tmp_path / "root" / "digits" / "version_0"
    assert sorted(p.name for p in (tmp_path / "root" / "digits").iterdir()) == ["version_0"]
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [r["epoch"] for r in rows if r.get("val_acc")] == ["0", "1"]  # one curve, both runs

    assert cli.main([*common, "--max-epochs", "2", "--resume"]) == 0
    assert "no epoch trained: the run already has 2; raise --max-epochs" in capsys.readouterr().out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_demo_on_two_processes_shares_one_run_directory(tmp_path: Path) -> None:
    done = run_demo_command(
        "--max-epochs", "1", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = summary(done.stdout)
    assert out["device"] == "cpu (2 processes, DDPStrategy)"
    assert "(1 epoch trained in" in out["time"]
    assert done.stdout.count("test accuracy:") == 1  # rank zero reports
    runs = tmp_path / "runs" / "demo" / "digits"
    assert [p.name for p in runs.iterdir()] == ["version_0"]  # both ranks wrote to the one rank zero chose
    assert (runs / "version_0" / "checkpoints" / "last" / "meta.json").exists()
    assert png_size(runs / "version_0" / PNG_NAME) == (1000, 400)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_reaches_97_percent_in_under_a_minute(tmp_path: Path) -> None:
    """The promise of the README: full settings, >= 97% on the held-out split, < 60 s in all."""
    done = run_demo_command("--accelerator", "cpu", cwd=tmp_path, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    out = summary(done.stdout)
    accuracy = float(out["test accuracy"].split("%")[0])
    seconds = float(out["time"].split(" s ")[0])
    assert accuracy >= 97.0, done.stdout[-2000:]
    assert seconds < 60.0, done.stdout[-2000:]
    assert math.isfinite(seconds)


def test_demo_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option in ("--accelerator", "--devices", "--strategy", "--precision", "--max-epochs", "--resume", "--root-dir"):
        assert option in text
    assert "pip install scikit-learn matplotlib (in a clone of torchrig: pip install -e '.[demo]')" in text


def test_zero_epochs_are_refused_before_anything_is_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--max-epochs", "0", "--accelerator", "cpu", "--root-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err == "torchrig demo: max_epochs=0 must be an int >= 1 (--max-epochs: how many epochs to train)\n"
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_a_demo_that_fails_before_writing_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("the model could not be built")

    monkeypatch.setattr("torchrig.demo.run.DigitsCNN", broken)
    with pytest.raises(RuntimeError, match="the model could not be built"):
        cli.main(["demo", "--max-epochs", "1", "--accelerator", "cpu", "--root-dir", str(tmp_path)])
    assert list((tmp_path / "digits").iterdir()) == []  # no empty version_0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inside", [False, True], ids=["root-dir-is-a-file", "a-file-above-root-dir"])
def test_a_root_dir_that_is_a_file_is_one_line_and_exit_2(
    inside: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocking = tmp_path / "notes ü.txt"
    blocking.write_text("the user's")
    root = blocking / "runs" if inside else blocking
    assert cli.main(["demo", "--max-epochs", "1", "--accelerator", "cpu", "--root-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"torchrig demo: root_dir={str(root)!r} must be a directory, but {blocking} exists and is not one; pass a "
        "folder, or a path that does not exist yet (--root-dir: where the runs are written)\n"
    )
    assert blocking.read_text() == "the user's"


@pytest.mark.timeout(60)
def test_demo_in_16_true_says_why_instead_of_training_to_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It trained to a NaN loss and 10% test accuracy (AdamW's eps is 0 in float16)."""
    argv = ["demo", "--precision", "16-true", "--max-epochs", "1", "--accelerator", "cpu", "--root-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchrig demo: AdamW(eps=1e-08) adds eps to parameters kept in torch.float16") and (
        err.endswith("or use a precision that keeps float32 parameters ('16-mixed', 'bf16-mixed')\n")
    ), err
    assert list((tmp_path / "digits").iterdir()) == []  # no empty version_0
