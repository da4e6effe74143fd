"""torchrig.EMA: the average after each optimizer step (not each micro-batch), validation on the
average, the average in checkpoints (safetensors; DCP shards under FSDP) and an exact resume,
stochastic weight averaging, and FSDP on 2 processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, docs_example, loader, quiet_trainer, subprocess_env

import torchrig
from conftest import run_example
from torchrig.trainer.ema import EMA


class Recorder(torchrig.Callback):
    """The module's floating-point tensors after every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self._last = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.steps.append({k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()})


class WeightSum(Regressor):
    """Validation logs the sum of the first layer's weight: which weights validation ran on."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("weight_sum", self.net[0].weight.sum())


def expected_average(start: dict[str, torch.Tensor], steps: list[dict[str, torch.Tensor]], decay: float) -> dict:
    average = {k: v.clone() for k, v in start.items()}
    for weights in steps:
        for k in average:
            average[k] = torch.lerp(average[k], weights[k], 1 - decay)
    return average


def ema_in_checkpoint(path: Path | str, out: Path) -> dict[str, torch.Tensor]:
    """The entry ``EMA.averaged`` of a checkpoint (sharded or not), through ``consolidate``."""
    import safetensors.torch

    flat = safetensors.torch.load_file(str(torchrig.checkpoint.consolidate(path, out)))
    prefix = "EMA.averaged."
    return {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}


def test_average_after_each_optimizer_step_not_each_micro_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Regressor()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    ema, recorder = EMA(decay=0.9), Recorder()
    trainer = quiet_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=3, callbacks=[recorder, ema])
    trainer.fit(module, loader(32, batch_size=4))  # 8 batches an epoch: steps after 3, 6 and 8
    assert trainer.global_step == len(recorder.steps) == ema.updates == 6
    assert ema.averaged is not None
    averaged = ema.averaged.state_dict()
    want = expected_average(start, recorder.steps, 0.9)
    assert averaged.keys() == want.keys()
    assert all(torch.equal(averaged[k], want[k]) for k in want)
    assert not torch.equal(averaged["net.0.weight"], module.state_dict()["net.0.weight"])


def test_validation_runs_on_the_average_and_training_is_unchanged(tmp_path: Path) -> None:
    finals, sums = [], []
    for callbacks in ([], [EMA(decay=0.5)]):
        torch.manual_seed(0)
        module = WeightSum()
        trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=callbacks, num_sanity_val_steps=2)
        trainer.fit(module, loader(32, batch_size=4), loader(8, batch_size=4))
        finals.append([p.detach().clone() for p in module.parameters()])
        sums.append(float(trainer.callback_metrics["weight_sum"]))
    # The trained weights are what they are without the callback (swapped back after each validation).
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    ema = callbacks[0]
    assert isinstance(ema, EMA) and ema.averaged is not None
    assert sums[0] == pytest.approx(float(finals[0][0].sum()), abs=1e-6)  # without: the trained weights
    assert sums[1] == pytest.approx(float(ema.averaged.state_dict()["net.0.weight"].sum()), abs=1e-6)
    assert sums[1] != pytest.approx(sums[0], abs=1e-4)


def test_a_failed_validation_puts_the_trained_weights_back(tmp_path: Path) -> None:
    class Fails(WeightSum):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if self.trainer.global_step >= 8:
                raise RuntimeError("validation broke")
            super().validation_step(batch, batch_idx)

    torch.manual_seed(0)
    module, ema, recorder = Fails(), EMA(decay=0.5), Recorder()
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[recorder, ema])
    with pytest.raises(RuntimeError, match="validation broke"):
        trainer.fit(module, loader(32, batch_size=4), loader(8, batch_size=4))
    trained = recorder.steps[-1]
    now = module.state_dict()
    assert all(torch.equal(now[k], trained[k]) for k in trained)


def test_checkpoint_holds_the_average_and_resume_is_exact(tmp_path: Path) -> None:
    data = loader(32, batch_size=4, shuffle=True)
    torch.manual_seed(0)
    straight = EMA(decay=0.8)
    quiet_trainer(tmp_path / "a", max_steps=10, seed=1, callbacks=[straight]).fit(Regressor(dropout=0.1), data)

    torch.manual_seed(0)
    first = EMA(decay=0.8)
    save = torchrig.ModelCheckpoint(every_n_train_steps=3, save_last=True)  # mid-epoch: an exact resume
    trainer = quiet_trainer(tmp_path / "b", max_steps=6, seed=1, callbacks=[first, save], enable_checkpointing=True)
    trainer.fit(Regressor(dropout=0.1), data)
    last = save.resolve_dirpath(trainer) / "last"
    assert last.resolve().name == "epoch=0-step=6"
    meta = json.loads((last / "meta.json").read_text())
    assert meta["entries"]["EMA.averaged"]["kind"] == "module"  # the module path: a safetensors file
    assert (last / "EMA.averaged.safetensors").is_file()
    assert meta["entries"]["callbacks"]["kind"] == "value"
    saved = ema_in_checkpoint(last, tmp_path / "weights.safetensors")
    assert first.averaged is not None
    assert all(torch.equal(saved[k], v) for k, v in first.averaged.state_dict().items())

    torch.manual_seed(5)  # other initial weights: everything comes from the checkpoint
    resumed = EMA(decay=0.8)
    again = quiet_trainer(tmp_path / "b", max_steps=10, seed=1, callbacks=[resumed])
    again.fit(Regressor(dropout=0.1), data, ckpt_path=last)
    assert resumed.updates == straight.updates == 10
    assert straight.averaged is not None and resumed.averaged is not None
    want, got = straight.averaged.state_dict(), resumed.averaged.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stochastic_weight_averaging_is_the_mean_since_swa_start(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Regressor()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    ema, recorder = EMA(decay=0.9, swa_start=5), Recorder()
    quiet_trainer(tmp_path, max_steps=12, callbacks=[recorder, ema]).fit(module, loader(32, batch_size=4))
    assert ema.updates == 12 and ema.swa_updates == 8  # steps 5 to 12 (global_step after the step)
    assert ema.averaged is not None
    got = ema.averaged.state_dict()
    for k in start:
        mean = torch.stack([s[k].double() for s in recorder.steps[4:]]).mean(0)
        torch.testing.assert_close(got[k].double(), mean, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got["net.0.weight"], expected_average(start, recorder.steps, 0.9)["net.0.weight"])


def test_copy_to_writes_the_average_into_the_module(tmp_path: Path) -> None:
    ema = EMA(decay=0.5)
    with pytest.raises(RuntimeError, match=re.escape("EMA.copy_to(): there is no average yet; fit with the EMA")):
        ema.copy_to()
    torch.manual_seed(0)
    module = Regressor()
    trainer = quiet_trainer(tmp_path, max_steps=4, callbacks=[ema])
    trainer.fit(module, loader(32, batch_size=4))
    with pytest.raises(ValueError, match="got a Regressor other than the module this EMA averaged"):
        ema.copy_to(Regressor())
    ema.copy_to(module)
    assert ema.averaged is not None
    averaged, now = ema.averaged.state_dict(), module.state_dict()
    assert all(torch.equal(now[k], averaged[k]) for k in averaged)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"decay": 1.0}, ValueError, "decay=1.0 must be in [0, 1): the average would never move"),
        ({"decay": -0.1}, ValueError, "decay=-0.1 must be a finite number >= 0"),
        ({"decay": float("nan")}, ValueError, "decay=nan must be a finite number >= 0"),
        ({"decay": "0.9"}, TypeError, "decay='0.9' must be a number, not str"),
        ({"swa_start": -1}, ValueError, "swa_start=-1 must be an int >= 0"),
        ({"swa_start": 2.0}, TypeError, "swa_start=2.0 must be an int, not float"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match="^" + re.escape(message)):
        EMA(**kwargs)


FSDP_SCRIPT = r"""
import json, sys
import torch
import torchrig
from trainer_helpers import Regressor, loader

def run(max_steps, ckpt_path=None, seed=0):
    torch.manual_seed(seed)
    module, ema = Regressor(), torchrig.EMA(decay=0.8)
    save = torchrig.ModelCheckpoint(every_n_train_steps=5, save_last=True)  # step 5 is mid-epoch: exact resume
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=2, strategy=sys.argv[2], max_steps=max_steps, enable_progress_bar=False,
        logger=False, default_root_dir=f"{sys.argv[1]}/{max_steps}{ckpt_path is None}", num_sanity_val_steps=0,
        callbacks=[ema, save],
    )
    trainer.fit(module, loader(32, batch_size=4), ckpt_path=ckpt_path)
    sharded = type(next(iter(ema.averaged.buffers()))).__name__
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in ema.averaged.state_dict().items()}
    return trainer, full, sharded

trainer, straight, sharded = run(8)
first, _, _ = run(5)
last = str(first.checkpoint_callback.resolve_dirpath(first) / "last")
_, resumed, _ = run(8, ckpt_path=last, seed=9)
if trainer.is_global_zero:
    sys.stdout.write(json.dumps({
        "sharded": sharded,
        "last": last,
        "average": {k: v.tolist() for k, v in straight.items()},
        "resumed_equal": all(torch.equal(resumed[k], straight[k]) for k in straight),
    }) + "\n")  # one write: ranks share the output
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_fsdp_two_processes_average_their_shards_like_one_process(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(FSDP_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "root"), "fsdp"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["sharded"] == "DTensor"  # each process averaged its own shards
    assert result["resumed_equal"]
    meta = json.loads((Path(result["last"]) / "meta.json").read_text())
    entry = {"kind": "module", "type": "torch.nn.modules.module.Module", "dcp": True}
    assert meta["sharded"] and meta["entries"]["EMA.averaged"] == entry
    # One process with the same global batches (2 x 4 samples per step) gives the same average.
    torch.manual_seed(0)
    ema = EMA(decay=0.8)
    quiet_trainer(tmp_path / "one", max_steps=8, callbacks=[ema]).fit(Regressor(), loader(32, batch_size=8))
    assert ema.averaged is not None
    for k, v in ema.averaged.state_dict().items():
        torch.testing.assert_close(torch.tensor(result["average"][k]), v, rtol=1e-5, atol=1e-6)
    from_checkpoint = ema_in_checkpoint(result["last"], tmp_path / "weights.safetensors")
    assert from_checkpoint.keys() == ema.averaged.state_dict().keys()
    for k, v in ema.averaged.state_dict().items():  # the step-5 average, gathered from the shards
        assert not torch.equal(from_checkpoint[k], v)


@pytest.mark.timeout(160)
def test_the_docs_example_runs_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    heading = "## Weight averaging: `torchrig.EMA`"
    out = run_example(docs_example(heading), heading, tmp_path, capsys)
    lines = out.splitlines()
    assert "64" in lines and "['EMA.averaged', 'callbacks']" in lines and lines[-1] == "True", out
