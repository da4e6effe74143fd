"""The jsonargparse CLI: subcommands, YAML configs, --print_config, errors, a custom accelerator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import PYTHON, python_env
from torchrig.trainer.cli import CLI
from torchrig.trainer.loggers import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_script import Line, Regressor, custom_accelerator


@pytest.fixture(autouse=True)
def _xpu_sim_registered() -> None:
    # conftest resets the registries to the built-ins before every test; the CLI tests select the
    # example's accelerator by name, as a user's script that imports it would.
    from torchrig import ACCELERATOR_REGISTRY

    custom_accelerator.XPUAccelerator.register_accelerators(ACCELERATOR_REGISTRY)


SCRIPT = Path(__file__).resolve().parent / "cli_script.py"


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, str(SCRIPT), *args], cwd=cwd, env=python_env(), capture_output=True, text=True, timeout=150
    )


def summary(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY "))
    return json.loads(line.removeprefix("SUMMARY "))


@pytest.mark.slow  # three subprocesses, each importing torch: about 15 s here, a minute on a busy machine
@pytest.mark.timeout(300)
def test_fit_with_a_yaml_config_then_test_from_the_checkpoint(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "accelerator": "cpu",
                    "devices": 1,
                    "max_epochs": 3,
                    "default_root_dir": str(tmp_path / "run"),
                    "log_every_n_steps": 1,
                    "seed": 0,
                },
                "model": {"hidden": 8, "lr": 0.05},
                "data": {"batch_size": 16},
            }
        )
    )
    # The custom accelerator from examples/custom_accelerator.py, chosen by name on the command line.
    fit = summary(run_script("fit", "--config", str(config), "--trainer.accelerator=xpu_sim", cwd=tmp_path))
    assert fit["accelerator"] == "xpu_sim"
    saved = yaml.safe_load((tmp_path / "run" / "torchrig_logs" / "version_0" / "config.yaml").read_text())
    assert saved["trainer"]["accelerator"] == "xpu_sim" and saved["trainer"]["max_epochs"] == 3
    assert saved["model"] == {"hidden": 8, "lr": 0.05}
    last = tmp_path / "run" / "torchrig_logs" / "version_0" / "checkpoints" / "last"  # beside config.yaml
    assert last.exists()
    rows = read_metrics(tmp_path / "run" / "torchrig_logs" / "version_0")
    assert [r["step"] for r in rows if "train_loss" in r] == list(range(1, 13))  # 4 batches x 3 epochs
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0]

    test = summary(
        run_script("test", "--config", str(config), "--trainer.logger=false", f"--ckpt_path={last}", cwd=tmp_path)
    )
    assert test["accelerator"] == "cpu"
    # The test set is the validation set: the checkpoint's test loss is the last validation loss.
    assert test["result"][0]["test_loss"] == pytest.approx(val[-1], rel=1e-5)
    # `--ckpt_path=last` from a new run (its own version_1, with no `last`): the newest fit's `last`.
    newest = summary(run_script("test", "--config", str(config), "--ckpt_path=last", cwd=tmp_path))
    assert newest["result"] == test["result"]
    fresh = summary(run_script("test", "--config", str(config), "--trainer.logger=false", cwd=tmp_path))
    assert fresh["result"][0]["test_loss"] > 2 * val[-1]  # an untrained model does worse


@pytest.mark.timeout(60)
def test_print_config_shows_file_values_and_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  max_epochs: 7\nmodel:\n  lr: 0.05\n")
    with pytest.raises(SystemExit) as exit_info:
        CLI(Regressor, Line, args=["fit", "--config", str(config), "--model.hidden=4", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_epochs"] == 7
    assert printed["trainer"]["accelerator"] is None and printed["trainer"]["enable_progress_bar"] is True
    assert printed["model"] == {"hidden": 4, "lr": 0.05}
    assert printed["data"] == {"n": 64, "batch_size": 16}
    assert printed["ckpt_path"] is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--model.hiden=3"], "unrecognized arguments: --model.hiden=3"),
        (["fit", "--model.hidden=wide"], "Parser key \"model.hidden\":\n  Expected a <class 'int'>. Got value: wide"),
        (["train"], "invalid choice: 'train'"),
        (
            ["fit", "--trainer.accelerator=xpu_sim", "--trainer.devices=2"],
            "ValueError: devices=2 asks for 2 xpu_sim devices, but this machine has 1",
        ),
    ],
)
def test_wrong_arguments_exit_2_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        CLI(Regressor, Line, args=args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_trainer_seed_also_fixes_the_models_first_weights(tmp_path: Path) -> None:
    """The model is built before the run seeds: ``trainer.seed`` is applied before it is built."""

    def weights(*extra: str) -> torch.Tensor:
        args = ["--trainer.logger=false", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"]
        cli = CLI(Regressor, Line, run=False, args=[*args, *extra])
        return torch.cat([p.detach().flatten() for p in cli.model.parameters()])

    assert torch.equal(weights("--trainer.seed=3"), weights("--trainer.seed=3"))
    assert not torch.equal(weights("--trainer.seed=3"), weights("--trainer.seed=4"))
    assert not torch.equal(weights(), weights())  # no seed: the weights are the RNG's


@pytest.mark.timeout(60)
def test_run_false_builds_the_objects_without_running(tmp_path: Path) -> None:
    cli = CLI(
        Regressor,
        Line,
        run=False,
        args=[
            "--model.hidden=3",
            "--trainer.logger=false",
            "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    assert cli.subcommand is None and cli.result is None
    assert isinstance(cli.model, Regressor) and cli.model.net[0].out_features == 3
    assert isinstance(cli.datamodule, Line)
    assert cli.trainer.loggers == [] and cli.trainer.rig.accelerator.name() == "cpu"


@pytest.mark.timeout(60)
def test_validate_and_predict_subcommands_run_in_process(tmp_path: Path) -> None:
    common = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"]
    validate = CLI(Regressor, Line, args=["validate", *common])
    assert validate.subcommand == "validate" and list(validate.result[0]) == ["val_loss"]
    predict = CLI(Regressor, Line, args=["predict", "--data.batch_size=20", *common])
    assert [len(batch) for batch in predict.result] == [20, 20, 20, 4]


def test_cli_wants_classes() -> None:
    with pytest.raises(
        TypeError, match=r"CLI\(module_class=...\) takes a class, got an instance of Regressor; pass the class"
    ):
        CLI(Regressor(), Line, args=["fit"])


def test_an_abbreviated_option_is_refused_with_the_error_first(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        CLI(Regressor, Line, args=["fit", "--trainer.max_epoch=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: unrecognized arguments: --trainer.max_epoch=3"
    assert "--help` for the options)" in err.splitlines()[1]
    assert "usage:" not in err


class _NoPredict(Line):
    """Line without a predict_dataloader.

    Args:
        n: how many points.
        batch_size: points per batch.
    """

    def predict_dataloader(self) -> None:
        raise NotImplementedError("_NoPredict defines no predict_dataloader()")


@pytest.mark.timeout(60)
def test_an_error_the_run_raises_is_a_message_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"]
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        CLI(Regressor, Line, args=["validate", "--ckpt_path=best", *common])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ValueError: ckpt_path='best' needs a ModelCheckpoint that has saved a checkpoint")
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:
        CLI(Regressor, _NoPredict, args=["predict", *common])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.startswith("error: NotImplementedError: _NoPredict defines no predict_dataloader()")
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")  # the traceback, for a bug report
    with pytest.raises(ValueError, match="ckpt_path='best' needs a ModelCheckpoint"):
        CLI(Regressor, Line, args=["validate", "--ckpt_path=best", *common])


def test_help_is_plain_text_without_sphinx_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        CLI(Regressor, Line, args=["fit", "--help"])
    out = capsys.readouterr().out
    assert "hardware, as for Rig (" in " ".join(out.split())
    for markup in (":class:", ":func:", ":meth:", ":attr:", "``"):
        assert markup not in out


@pytest.mark.timeout(60)
def test_a_fit_that_fails_before_writing_leaves_no_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)
    common = ["--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit_info:
        CLI(Regressor, Line, args=["fit", f"--ckpt_path={tmp_path / 'missing'}", *common])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.startswith("error: FileNotFoundError: ")
    assert list((tmp_path / "torchrig_logs").iterdir()) == []  # not a version_0 holding only config.yaml
    CLI(Regressor, Line, args=["fit", "--trainer.max_epochs=1", *common])  # a run that trains keeps it
    assert (tmp_path / "torchrig_logs" / "version_0" / "config.yaml").is_file()
