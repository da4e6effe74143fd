"""Issue 31, section 2: a torchrig ``Trainer.fit`` inside Ray Train (``ray.train.torch.TorchTrainer``
on a local Ray cluster with 2 CPU workers, ``scripts/ray_fit.py``) trains the weights of
``torchrig run --devices 2``. Ray is an optional extra (``pip install torchrig[ray]``)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, env, explain, same_weights, torchrig_run_fit

NO_RAY = "Ray is not installed: pip install -c constraints.txt -e '.[test]' (or torchrig[ray])"
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason=NO_RAY)]

EXTRA = ["--epochs", "2"]


@pytest.mark.timeout(300)
def test_ray_train_two_workers_fit_matches_torchrig_run(tmp_path: Path) -> None:
    reference = torchrig_run_fit(tmp_path, *EXTRA)
    out = tmp_path / "ray.pt"
    cmd = [sys.executable, str(SCRIPTS / "ray_fit.py"), str(tmp_path / "ray"), str(out), *EXTRA]
    ray_env = {**env(), "RAY_USAGE_STATS_ENABLED": "0"}
    # Its own session: on a timeout the whole group goes (ray.init's raylet and GCS die with the driver).
    proc = subprocess.Popen(cmd, env=ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, "")
    assert proc.returncode == 0, explain(done)
    assert "ray train finished: error=None" in stdout, explain(done)
    for rank in (0, 1):
        # Ray Train sets torchrun's variables in each worker and joins them in a gloo group itself.
        assert f"rank {rank} of 2 launched by torchrun" in stdout, explain(done)
        assert f"rank {rank} done at step 12" in stdout, explain(done)
    same_weights(reference, out)
