"""predict on N processes returns every output leaf gathered the same way: ids (plain objects) and
tensors stay paired and equal the one-process result; an empty training loader is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from trainer_helpers import Regressor, loader, quiet_trainer, regression_data, subprocess_env

import torchrig


class Named(Dataset[dict[str, Any]]):
    """Sample ``i``: ``{"id": "s<i>", "x": [i]}`` (collated to a list of ids and a tensor)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": f"s{i}", "x": torch.tensor([float(i)])}


class IdPredictor(Regressor):
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return {"id": batch["id"], "pred": batch["x"][:, 0] * 10, "batch": batch_idx}


def dropping(n: int) -> DataLoader[Any]:
    return DataLoader(regression_data(n), batch_size=4, drop_last=True)


def flatten(outputs: list[Any]) -> tuple[list[str], list[float]]:
    ids = [i for out in outputs for i in out["id"]]
    preds = [float(p) for out in outputs for p in out["pred"]]
    return ids, preds


SCRIPT = r"""
import json, sys
from torch.utils.data import DataLoader
import torchrig
from test_predict_gather import IdPredictor, Named, flatten
from trainer_helpers import Regressor, regression_data

trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", enable_progress_bar=False, logger=False,
    enable_checkpointing=False, default_root_dir=sys.argv[1], max_epochs=2,
)
# 11 samples: each rank gets 6 (the sampler repeats one), in batches of 4 and 2
outputs = trainer.predict(IdPredictor(), DataLoader(Named(11), batch_size=4))
ids, preds = flatten(outputs)
# 5 samples, batch_size=4, drop_last: one batch in one process, none in each of two (3 samples each)
try:
    trainer.fit(Regressor(), DataLoader(regression_data(5), batch_size=4, drop_last=True))
    empty = "no error"
except ValueError as err:
    empty = str(err)
if trainer.is_global_zero:
    sys.stdout.write(json.dumps({
        "ids": ids, "preds": preds, "batches": [o["batch"] for o in outputs],
        "sizes": [len(o["id"]) for o in outputs], "empty": empty, "epochs": trainer.current_epoch,
    }) + "\n")  # one write: ranks share the output
"""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("predict_gather")
    script = tmp / "run.py"
    script.write_text(SCRIPT)
    env = subprocess_env()
    env["PYTHONPATH"] = str(Path(__file__).parent) + ":" + env["PYTHONPATH"]
    done = subprocess.run(
        [sys.executable, str(script), str(tmp)], env=env, capture_output=True, text=True, timeout=110, cwd=tmp
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_predict_gathers_ids_and_tensors_in_the_same_order(tmp_path: Path, two_processes: dict[str, Any]) -> None:
    one = quiet_trainer(tmp_path).predict(IdPredictor(), DataLoader(Named(11), batch_size=4))
    assert flatten(one) == ([f"s{i}" for i in range(11)], [10.0 * i for i in range(11)])
    assert (two_processes["ids"], two_processes["preds"]) == flatten(one)  # paired, in order, no duplicate
    assert two_processes["sizes"] == [8, 3]  # the padded repeat is dropped from ids as from preds
    assert two_processes["batches"] == [[0, 0], [1, 1]]  # a non-batch object: every rank's value


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_a_training_loader_empty_on_every_process_is_refused(two_processes: dict[str, Any]) -> None:
    assert two_processes["empty"].startswith(
        "train_dataloaders has 0 batches on process 0 of 2 (5 samples, batch_size=4, drop_last=True)"
    ), two_processes["empty"]
    assert "a sampler that leaves a process's share of the dataset empty" in two_processes["empty"]
    assert two_processes["epochs"] == 0


@pytest.mark.timeout(30)
def test_an_empty_training_loader_stops_before_the_first_epoch(tmp_path: Path) -> None:
    started: list[int] = []

    class Counting(Regressor):
        def on_train_epoch_start(self) -> None:
            started.append(1)

    trainer = quiet_trainer(tmp_path, max_epochs=1000)
    expected = (
        r"^train_dataloaders has 0 batches \(3 samples, batch_size=4, drop_last=True\), so the fit would train "
        r"nothing\. Common causes: a dataset smaller than batch_size with drop_last=True"
    )
    with pytest.raises(ValueError, match=expected):
        trainer.fit(Counting(), dropping(3))
    assert started == [] and trainer.current_epoch == 0
    with pytest.raises(ValueError, match=r"0 batches under limit_train_batches=0\.1 \(32 samples"):
        quiet_trainer(tmp_path, limit_train_batches=0.1).fit(Regressor(), loader(32, batch_size=4))
    quiet_trainer(tmp_path, limit_train_batches=0, max_epochs=1).fit(Regressor(), dropping(3))


def test_gather_in_one_process_returns_the_outputs_unchanged() -> None:
    rig = torchrig.Rig(accelerator="cpu")
    out = {"id": ["a", "b"], "pred": torch.ones(2)}
    assert rig.gather_for_metrics(out) is out


class Nothing(torch.utils.data.IterableDataset[Any]):
    def __iter__(self) -> Any:
        return iter(())


@pytest.mark.timeout(30)
def test_a_training_loader_without_length_that_gives_nothing_stops_after_one_epoch(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1000, val_check_interval=10)
    with pytest.raises(ValueError, match=r"^train_dataloaders has 0 batches \(a dataset, batch_size=4, drop_last=Fals"):
        trainer.fit(Regressor(), DataLoader(Nothing(), batch_size=4))
    assert trainer.current_epoch == 0
