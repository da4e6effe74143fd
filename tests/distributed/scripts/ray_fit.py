"""``preempt_fit.py``'s 2-process fit inside Ray Train: a local Ray cluster (started here, stopped
at the end), ``ray.train.torch.TorchTrainer`` with 2 CPU workers, each running ``Trainer.fit``.

    python ray_fit.py ROOT OUT [preempt_fit options]

Ray Train starts the workers, sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` in each and joins them in a gloo process group; torchrig takes the ranks from those
variables (as from torchrun) and uses the process group Ray made.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

SCRIPTS = str(Path(__file__).resolve().parent)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    sys.path.insert(0, SCRIPTS)
    import preempt_fit

    preempt_fit.main(config["argv"])


def main() -> None:
    root = Path(sys.argv[1])
    # Ray's sockets live under its temporary folder, whose path must stay short.
    temp = tempfile.mkdtemp(prefix="ray")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, log_to_driver=True)
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"argv": sys.argv[1:]},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=str(root / "ray_results"), name="torchrig"),
        )
        result = trainer.fit()
        print(f"ray train finished: error={result.error}", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
