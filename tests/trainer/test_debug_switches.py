"""Quick-debugging switches: fast_dev_run, overfit_batches, detect_anomaly; the rank properties."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from trainer_helpers import Regressor, loader, printed_json, quiet_trainer, regression_data

import torchrig


class Counting(Regressor):
    """Records the first input of every batch each loop sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[list[float]]] = {"train": [], "val": [], "test": [], "predict": []}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train"].append(batch[0][0].tolist())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["val"].append(batch[0][0].tolist())
        super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["test"].append(batch[0][0].tolist())
        super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["predict"].append(batch[0][0].tolist())
        return super().predict_step(batch, batch_idx)


@pytest.mark.parametrize(("value", "batches"), [(True, 1), (3, 3)])
def test_fast_dev_run_runs_n_batches_of_each_loop_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: Any, batches: int
) -> None:
    monkeypatch.chdir(tmp_path)
    module = Counting()
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=5,
        num_sanity_val_steps=2,
        val_check_interval=4,
        logger=True,  # the CSVLogger would write under tmp_path
        callbacks=[torchrig.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        fast_dev_run=value,
    )
    assert trainer.loggers == [] and trainer.checkpoint_callback is None
    data = loader(32, batch_size=4)  # 8 batches
    trainer.fit(module, data, loader(16, batch_size=4))
    trainer.test(module, loader(16, batch_size=4))
    trainer.predict(module, loader(16, batch_size=4))
    assert {k: len(v) for k, v in module.seen.items()} == dict.fromkeys(module.seen, batches)
    assert trainer.current_epoch == 1 and trainer.global_step == batches
    assert list(tmp_path.iterdir()) == []  # no logs, no checkpoints, no hparams
    plural = "es" if batches > 1 else ""
    assert f"fast_dev_run={value!r}: {batches} batch{plural} of each loop, 1 epoch" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1, ValueError, "fast_dev_run=-1 is negative; give True (1 batch), False, or an int number of batches >= 1"),
        (1.5, TypeError, "fast_dev_run=1.5 must be a bool or an int, not float"),
        ("yes", TypeError, "fast_dev_run='yes' must be a bool or an int, not str"),
    ],
)
def test_fast_dev_run_refuses_bad_values(tmp_path: Path, value: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        quiet_trainer(tmp_path, fast_dev_run=value)
    assert str(info.value) == message


def test_fast_dev_run_and_overfit_batches_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fast_dev_run=2 and overfit_batches=3 both limit the batches; give one"):
        quiet_trainer(tmp_path, fast_dev_run=2, overfit_batches=3)


@pytest.mark.parametrize("overfit", [2, 0.25])
def test_overfit_batches_trains_on_the_same_unshuffled_batches_every_epoch(tmp_path: Path, overfit: Any) -> None:
    module = Counting()
    trainer = quiet_trainer(tmp_path, max_epochs=3, overfit_batches=overfit)
    shuffled = DataLoader(regression_data(32), batch_size=4, shuffle=True)  # 8 batches
    trainer.fit(module, shuffled, loader(32, batch_size=4))
    epochs = [module.seen["train"][i : i + 2] for i in range(0, 6, 2)]
    assert len(module.seen["train"]) == 6  # 2 batches an epoch
    assert epochs[0] == epochs[1] == epochs[2]
    first_two = [regression_data(32)[i][0].tolist() for i in (0, 4)]  # dataset order: no shuffling
    assert epochs[0] == first_two
    assert len(module.seen["val"]) == 3 * 2  # validation limited the same way


def test_without_overfit_batches_the_shuffled_epochs_differ(tmp_path: Path) -> None:
    """The control for the test above: the same loader shuffles each epoch when not overfitting."""
    module = Counting()
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_train_batches=2)
    trainer.fit(module, DataLoader(regression_data(32), batch_size=4, shuffle=True))
    assert module.seen["train"][:2] != module.seen["train"][2:]


@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_overfit_batches_refuses_bad_values(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"overfit_batches={value!r}: give an int number of batches \(>= 0\)"):
        quiet_trainer(tmp_path, overfit_batches=value)


class NanBackward(Regressor):
    """A forward that is finite but whose backward makes NaN (0 * the infinite slope of sqrt at 0)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.sqrt(self(batch[0]) * 0).sum()


def test_detect_anomaly_names_the_operation_whose_backward_made_nan(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, detect_anomaly=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning with the forward's traceback
        with pytest.raises(RuntimeError, match=r"Function 'MulBackward0' returned nan values in its 0th output"):
            trainer.fit(NanBackward(), loader(8, batch_size=4))
    assert not torch.is_anomaly_enabled()  # only for the fit


def test_without_detect_anomaly_the_nan_goes_unnoticed(tmp_path: Path) -> None:
    module = NanBackward()
    quiet_trainer(tmp_path, max_epochs=1).fit(module, loader(8, batch_size=4))
    assert any(p.isnan().any() for p in module.parameters())


def test_detect_anomaly_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^detect_anomaly='yes' must be True or False$"):
        quiet_trainer(tmp_path, detect_anomaly="yes")


def test_rank_properties_in_one_process(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path)
    ranks = (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size)
    assert ranks == (0, 0, 0, 1)


TWO_PROCESSES = r"""
import json, os, sys
import torch
from torch.utils.data import DataLoader
import torchrig
from trainer_helpers import regression_data
from test_debug_switches import Counting

root = sys.argv[1]
common = dict(accelerator="cpu", devices=2, strategy="ddp", enable_progress_bar=False, default_root_dir=root)
module = Counting()
trainer = torchrig.Trainer(max_epochs=3, overfit_batches=2, logger=False, enable_checkpointing=False, **common)
trainer.fit(module, DataLoader(regression_data(32), batch_size=4, shuffle=True))
quick = torchrig.Trainer(fast_dev_run=True, max_epochs=4, **common)  # logger and checkpoint as by default
quick_module = Counting()
quick.fit(quick_module, DataLoader(regression_data(32), batch_size=4, shuffle=True))
row = {"rank": trainer.global_rank, "train": module.seen["train"], "quick": len(quick_module.seen["train"]),
       "written": sorted(os.listdir(root))}
sys.stdout.write(json.dumps(row) + "\n")
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_overfit_batches_and_fast_dev_run_on_two_processes(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from trainer_helpers import subprocess_env

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = tmp_path / "run.py"
    script.write_text(TWO_PROCESSES)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, str(script), str(run_dir)], env=env, capture_output=True, text=True, timeout=110, cwd=run_dir
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted(printed_json(done.stdout), key=str)
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        epochs = [row["train"][i : i + 2] for i in range(0, 6, 2)]
        assert epochs[0] == epochs[1] == epochs[2]  # each rank: the same 2 batches every epoch
        assert row["quick"] == 1 and row["written"] == []  # fast_dev_run: 1 batch, nothing on disk
    assert rows[0]["train"][:2] != rows[1]["train"][:2]  # the ranks share the batches' samples out
