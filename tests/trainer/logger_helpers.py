"""For the W&B and MLflow logger tests: W&B kept offline and on disk, its runs read back with
wandb's own reader, and a module whose logged values are known in advance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from trainer_helpers import Regressor


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """Environment variables that keep W&B offline, quiet and out of the home directory."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_home" / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_home" / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_home" / "data"),
        "WANDB_ARTIFACT_DIR": str(tmp_path / "wandb_home" / "artifacts"),
    }


def wandb_runs(save_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The records of each offline run under ``save_dir/wandb`` (by run id, in file order), read
    with ``wandb leet inspect --json`` (W&B's reader of its ``.wandb`` transaction logs). A run
    opened again (a second fit or a test with the same logger) has one file per opening."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((save_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        runs.setdefault(path.stem.removeprefix("run-"), []).extend(records)
    return runs


def of_type(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r[kind] for r in records if r["type"] == kind]


def exit_codes(records: list[dict[str, Any]]) -> list[int]:
    """The exit code each opening of the run ended with (protobuf's JSON may leave out a zero)."""
    return [int(r.get("exit_code", 0)) for r in of_type(records, "exit")]


def history(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The logged rows by step, without W&B's own ``_runtime``/``_timestamp``/``_step``."""
    rows: dict[int, dict[str, Any]] = {}
    for h in of_type(records, "history"):
        item = {k: v for k, v in h["item"].items() if not k.startswith("_")}
        rows.setdefault(int(h["step"]["num"]), {}).update(item)
    return rows


def float32(rows: dict[int, dict[str, Any]]) -> dict[int, dict[str, float]]:
    """``rows`` with every value as the float32 it was logged as (a float32 metric reads back exactly)."""
    return {step: {k: float(np.float32(v)) for k, v in row.items()} for step, row in rows.items()}


class Counting(Regressor):
    """Logs ``seen`` = ``10 * global_rank + batch_idx + 0.5`` at each step (so a value from
    another rank than zero would show), besides the Regressor's losses."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("seen", torch.tensor(10.0 * self.trainer.global_rank + batch_idx + 0.5))
        return loss


class Crashing(Counting):
    """Raises at the third training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            raise RuntimeError("boom at step 3")
        return super().training_step(batch, batch_idx)
