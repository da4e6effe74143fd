"""Two torchrun invocations on this machine joined as 2 nodes over 127.0.0.1 (1 process each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, assert_matches_reference, env, explain, result

from torchrig.strategies.launch import find_free_port

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(150)
def test_two_torchrun_nodes_train_to_completion(tmp_path: Path) -> None:
    port = find_free_port()
    out = tmp_path / "w.pt"
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(SCRIPTS / "train.py"),
            "--out",
            str(out),
            "--accelerator",
            "cpu",
        ]
        procs.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=130) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, explain(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    weights, info = result(out)
    # strategy="auto" under torchrun with WORLD_SIZE=2 picks ddp
    assert info["world_size"] == 2 and info["strategy"] == "DDPStrategy"
    assert_matches_reference(weights)
