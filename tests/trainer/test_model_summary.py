"""The model summary a fit prints when it starts: rows, counts, sizes in the run's precision,
switched off with enable_model_summary=False, full counts under FSDP on 2 processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer, subprocess_env

import torchrig
from torchrig.trainer.summary import format_bytes, summarize, summary_table


class Mixed(torchrig.TrainingModule):
    """Trainable and frozen layers, a weight shared by two layers, a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.embed.weight.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.tied = torch.nn.Linear(4, 4, bias=False)
        self.tied.weight = self.head.weight
        self.scale = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.body(x) * self.scale.sum()
        return torch.nn.functional.mse_loss(self.tied(self.head(h)).sum(1, keepdim=True), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def test_summarize_counts_each_layer_and_the_total_once() -> None:
    module = Mixed()
    rows, total = summarize(module)
    table = {r.name: (r.type, r.trainable, r.frozen, r.bytes) for r in rows}
    assert table == {
        "embed": ("Embedding", 0, 40, 160),
        "body": ("Sequential", 4 * 8 + 8 + 8 * 4 + 4, 0, 76 * 4),
        "head": ("Linear", 16, 0, 64),
        "tied": ("Linear", 16, 0, 64),  # the shared weight is in both layers...
        "(own parameters)": ("Mixed", 3, 0, 12),
    }
    assert total.params == sum(p.numel() for p in module.parameters()) == 40 + 76 + 16 + 3  # ...once in the total
    assert (total.trainable, total.frozen) == (76 + 16 + 3, 40)


def test_a_fit_prints_the_summary_at_its_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(Mixed(), loader(8))
    out = capsys.readouterr().out
    assert out.startswith(" ") and "Model summary: Mixed in 32-true" in out.splitlines()[0]
    lines = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]
    assert "0 embed Embedding 0 40 160 B" in lines
    assert "1 body Sequential 76 0 304 B" in lines
    assert "4 (own parameters) Mixed 3 0 12 B" in lines
    assert "total 95 40 540 B" in lines
    assert out == summary_table(Mixed(), "32-true")  # nothing else printed


def test_summary_size_follows_the_run_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(tmp_path, max_steps=1, precision="bf16-true")
    trainer.fit(Regressor(), loader(8))
    out = capsys.readouterr().out
    assert "Model summary: Regressor in bf16-true" in out
    lines = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]
    assert "total 49 0 98 B" in lines  # 2 bytes a parameter (32-true: 196 B)


def test_enable_model_summary_false_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(tmp_path, max_steps=1, enable_model_summary=False)
    trainer.fit(Regressor(), loader(8))
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="enable_model_summary='no' must be True or False"):
        quiet_trainer(tmp_path, enable_model_summary="no")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 999, 1000, 1_500_000, 2 * 10**9)] == [
        "0 B",
        "999 B",
        "1.0 KB",
        "1.5 MB",
        "2.0 GB",
    ]


class Wide(torchrig.TrainingModule):
    """Built from its hyperparameters (the FSDP test's module)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


FSDP_SCRIPT = r"""
import json, sys
import torch
import torchrig
from trainer_helpers import loader
from test_model_summary import Wide

trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="fsdp", max_steps=2, enable_progress_bar=False, logger=False,
    default_root_dir=sys.argv[1],
)
module = Wide(hidden=48)
trainer.fit(module, loader(16, batch_size=2))
local = sum(p.to_local().numel() for p in module.parameters())
full = {name: p.full_tensor().tolist() for name, p in module.named_parameters()}  # every rank takes part
with open(f"{sys.argv[1]}/rank{trainer.global_rank}.json", "w") as f:  # long lines of 2 ranks would interleave
    json.dump({"rank": trainer.global_rank, "local": local, "full": full}, f)
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_fsdp_summary_counts_the_full_model_and_its_checkpoint_loads_back(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(FSDP_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    full = 4 * 48 + 48 + 48 + 1
    lines = [" ".join(line.replace("│", " ").split()) for line in done.stdout.splitlines()]
    assert f"total {full} 0 1.2 KB" in lines and f"0 body Sequential {full} 0 1.2 KB" in lines  # unsharded counts
    assert sum("Model summary: Wide in 32-true" in line for line in lines) == 1
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["local"] < full for r in ranks) and ranks[0]["full"] == ranks[1]["full"]  # it was sharded
    # The sharded checkpoint builds the module from its hparams, with the trained full weights.
    loaded = Wide.load_from_checkpoint(tmp_path / "checkpoints" / "last")
    assert loaded.hparams == {"hidden": 48}
    trained = ranks[0]["full"]
    assert {n: p.tolist() for n, p in loaded.named_parameters()} == trained
