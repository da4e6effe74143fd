"""`torchrig run` end to end (through torchrun), and how it builds torchrun's arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, assert_matches_reference, explain, result, run

from torchrig.commands.run import script_env, torchrun_args


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_torchrig_run_forwards_options_and_trains(tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    proc = run(
        [
            "-m",
            "torchrig.cli",
            "run",
            "--devices",
            "2",
            "--accelerator",
            "cpu",
            "--strategy",
            "ddp",
            "--precision",
            "32",
            str(SCRIPTS / "train.py"),
            "--out",
            str(out),
        ]
    )
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    # the script passes nothing to Rig(): everything came through TORCHRIG_* variables
    assert info == {**info, "world_size": 2, "strategy": "DDPStrategy", "precision": "32-true"}
    assert_matches_reference(weights)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_torchrig_run_reports_the_failing_rank() -> None:
    proc = run(["-m", "torchrig.cli", "run", "--devices", "2", "--accelerator", "cpu", str(SCRIPTS / "fail.py")])
    assert proc.returncode == 1, explain(proc)
    assert "rank 1 failed first (exit code 1): RuntimeError: boom on purpose at step 3" in proc.stderr, explain(proc)


def _args(**kw: object) -> argparse.Namespace:
    base = {
        "devices": "2",
        "num_nodes": 1,
        "node_rank": 0,
        "master_addr": None,
        "master_port": None,
        "accelerator": None,
        "strategy": None,
        "precision": None,
        "max_restarts": 0,
        "script": "s.py",
        "script_args": ["--x", "1"],
    }
    return argparse.Namespace(**{**base, **kw})


def test_single_node_uses_a_standalone_rendezvous() -> None:
    assert torchrun_args(_args(), 2) == [
        "--nproc-per-node=2",
        "--nnodes=1",
        "--max-restarts=0",
        "--standalone",
        "s.py",
        "--x",
        "1",
    ]


def test_multi_node_passes_address_port_and_rank() -> None:
    args = _args(num_nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert torchrun_args(args, 4)[:6] == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--max-restarts=0",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "--master-port=29500",
    ]


def test_multi_node_without_an_address_is_an_error() -> None:
    with pytest.raises(ValueError, match="--num-nodes 2 needs --master-addr and --master-port"):
        torchrun_args(_args(num_nodes=2), 1)
    with pytest.raises(ValueError, match=r"--node-rank 2 must be in 0..1"):
        torchrun_args(_args(num_nodes=2, node_rank=2, master_addr="h", master_port=1), 1)


def test_options_reach_the_script_as_torchrig_variables() -> None:
    env = script_env(_args(accelerator="cpu", strategy="fsdp", precision="bf16-mixed", num_nodes=2))
    assert env == {
        "TORCHRIG_DEVICES": "2",
        "TORCHRIG_NUM_NODES": "2",
        "TORCHRIG_ACCELERATOR": "cpu",
        "TORCHRIG_STRATEGY": "fsdp",
        "TORCHRIG_PRECISION": "bf16-mixed",
    }
