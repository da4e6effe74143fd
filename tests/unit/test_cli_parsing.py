"""The ``torchrig`` command line: whose options are whose, and what a wrong one prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from torchrig.cli import build_parser, main
from torchrig.commands.run import torchrun_args, torchrun_config

SCRIPT_OPTIONS = ["--ma", "5", "--log", "X", "--max", "3", "--devices", "7", "--", "--precision"]


def test_everything_after_the_script_is_the_scripts() -> None:
    argv = ["run", "--devices", "2", "--max-restarts", "1", "s.py", *SCRIPT_OPTIONS]
    args = build_parser().parse_args(argv)
    assert (args.script, args.script_args, args.devices, args.max_restarts) == ("s.py", SCRIPT_OPTIONS, "2", 1)
    # torchrun's own parser (which knows --master-addr, --max-restarts, --log-dir...) sees none of them
    config = torchrun_config(torchrun_args(args, 2), args.script_args)
    assert (config.training_script, config.training_script_args) == ("s.py", SCRIPT_OPTIONS)
    assert (config.nproc_per_node, config.max_restarts, config.standalone) == ("2", 1, True)


@pytest.mark.distributed  # torchrun and its worker process
@pytest.mark.timeout(120)
def test_torchrig_run_hands_the_script_its_own_options(tmp_path: Path) -> None:
    import subprocess

    from conftest import python_env

    out = tmp_path / "argv.json"
    script = tmp_path / "show_argv.py"
    script.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n")
    cmd = [sys.executable, "-m", "torchrig.cli", "run", "--devices", "1", "--accelerator", "cpu", str(script)]
    proc = subprocess.run(
        [*cmd, *SCRIPT_OPTIONS], env=python_env(), capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == SCRIPT_OPTIONS


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (["demo", "--max-epoch", "1"], "usage: torchrig demo ", "unrecognized arguments: --max-epoch 1"),
        (["run", "--dev", "2", "s.py"], "usage: torchrig run ", "unrecognized arguments: --dev\n"),
        (["env", "--js"], "usage: torchrig env ", "unrecognized arguments: --js"),
        (["checkpoint", "inspect", "p", "--bogus"], "usage: torchrig checkpoint inspect ", "arguments: --bogus"),
        (["--bogus"], "usage: torchrig [-h]", "unrecognized arguments: --bogus"),
    ],
)
def test_an_unknown_or_abbreviated_option_is_refused_with_its_commands_usage(
    argv: list[str], usage: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert error in err, err


def test_run_without_a_script_says_the_script_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--devices", "2"])
    err = capsys.readouterr().err
    assert "torchrig run: error: the following arguments are required: script\n" in err, err


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (["--precision", "17"], "torchrig run: unknown --precision='17'; choose from 32-true, 64-true, 16-mixed,"),
        (["--strategy", "dpp"], "torchrig run: --strategy='dpp': unknown strategy 'dpp'; known: "),
        (["--strategy", "single"], "torchrig run: --strategy 'single' runs one process on one device, but 2 device"),
        (["--num-nodes", "0"], "torchrig run: --num-nodes=0 must be an int >= 1 (the number of machines)\n"),
        (["--num-nodes", "-1"], "torchrig run: --num-nodes=-1 must be an int >= 1 (the number of machines)\n"),
        (["--node-rank", "3"], "torchrig run: --node-rank 3 must be in 0..0 (--num-nodes 1)\n"),  # was ignored
        (
            ["--num-nodes", "2", "--master-addr", "localhost", "--master-port", "99999"],
            "torchrig run: --master-port 99999 must be a TCP port, 1..65535\n",  # was torchrun's traceback
        ),
    ],
)
def test_run_checks_every_option_before_starting_a_worker(
    option: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    assert main(["run", "--devices", "2", "--accelerator", "cpu", *option, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(error), err
    assert err.count("\n") == 1, err  # one line, no worker's traceback
    assert not started.exists()


@pytest.mark.parametrize("kind", ["missing", "a directory"])
def test_run_names_a_script_it_cannot_run(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "my scripts ü"
    if kind == "a directory":
        script.mkdir()
    assert main(["run", "--devices", "1", str(script)]) == 2
    problem = "is a directory, not a Python script" if kind == "a directory" else "no such script"
    assert capsys.readouterr().err == f"torchrig run: {script}: {problem}\n"


@pytest.mark.timeout(60)
def test_help_and_version_import_no_torch() -> None:
    import subprocess

    from conftest import python_env

    code = (
        "import sys\n"
        "from torchrig.cli import main\n"
        "for argv in (['--version'], ['--help'], ['run', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=python_env(), capture_output=True, text=True, timeout=50, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torchrig 0.1.0\nusage: torchrig [-h] [--version] COMMAND ...\n"), proc.stdout
    assert "usage: torchrig run [-h]" in proc.stdout
    assert proc.stdout.endswith("torch imported: False\n"), proc.stdout


def test_the_public_names_load_on_first_use() -> None:
    import torchrig
    import torchrig.resolve  # the module of the same name does not hide the function

    assert callable(torchrig.resolve) and torchrig.resolve.__module__ == "torchrig.resolve"
    assert {name: getattr(torchrig, name) for name in torchrig.__all__}  # every name resolves
    assert set(torchrig.__all__) <= set(dir(torchrig))
    with pytest.raises(AttributeError, match="module 'torchrig' has no attribute 'Rigg'"):
        torchrig.Rigg  # noqa: B018
