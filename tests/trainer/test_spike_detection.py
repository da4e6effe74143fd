"""SpikeDetection: the spikes Lightning's callback finds, stopping or skipping the step, its
window across a resume, its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import checkpointed_fit, lightning_trainer, loader, params, quiet_trainer, run_script

import torchrig

SPIKE_AT = (1, 5)  # (epoch, batch) whose loss is multiplied by 50
RTOL = 5.0  # at Lightning's 2.0 both find a spike in batch 3 of the first epoch already


class SpikySteps:
    """Plain SGD (no momentum: a skipped step is a step with zero gradients) on a regression
    whose loss at SPIKE_AT is ``factor`` times larger; for torchrig's module and Lightning's alike."""

    net: torch.nn.Linear
    factor = 50.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        epoch = self.trainer.current_epoch  # type: ignore[attr-defined]
        return loss * self.factor if (epoch, batch_idx) == SPIKE_AT else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.02)  # type: ignore[attr-defined]


class Spiky(SpikySteps, torchrig.TrainingModule):
    """``zero_at_spike``: the spike batch's loss times 0, for comparison."""

    def __init__(self, zero_at_spike: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.factor = 0.0 if zero_at_spike else 50.0


def lightning_spike(tmp_path: Path, start: dict[str, torch.Tensor], rtol: float) -> tuple[str, list[int]]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import SpikeDetection

    class LSpiky(SpikySteps, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

    model = LSpiky()
    model.load_state_dict(start)
    spikes = SpikeDetection(rtol=rtol, exclude_batches_path=tmp_path / "theirs.json")
    trainer = lightning_trainer(tmp_path, max_epochs=3, callbacks=[spikes])
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(model, loader(32, batch_size=4))
    return str(raised.value), json.loads((tmp_path / "theirs.json").read_text())


@pytest.mark.parametrize(("rtol", "batch"), [(2.0, 3), (RTOL, 5)])  # at 2.0 a natural spike in epoch 0
def test_spike_stops_the_fit_where_lightnings_does(tmp_path: Path, rtol: float, batch: int) -> None:
    torch.manual_seed(0)
    module = Spiky()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    spikes = torchrig.SpikeDetection(rtol=rtol, exclude_batches_path=tmp_path / "ours.json")
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[spikes])
    with pytest.raises(torchrig.TrainingSpikeException, match=f"Training spike detected in batch {batch}"):
        trainer.fit(module, loader(32, batch_size=4))
    assert spikes.bad_batches == json.loads((tmp_path / "ours.json").read_text()) == [batch - 1, batch]
    message, theirs = lightning_spike(tmp_path, start, rtol)
    assert message == f"Training spike detected in batch {batch}" and theirs == [batch - 1, batch]


def test_spike_skip_drops_the_batch_step_and_goes_on(tmp_path: Path, capsys: Any) -> None:
    torch.manual_seed(0)
    skipped = Spiky()
    spikes = torchrig.SpikeDetection(on_spike="skip", rtol=RTOL)
    quiet_trainer(tmp_path, max_epochs=3, callbacks=[spikes]).fit(skipped, loader(32, batch_size=4))
    assert spikes.bad_batches == json.loads((tmp_path / "skip_batches.json").read_text()) == [4, 5]
    assert "loss spike in batch 5; its step skipped" in capsys.readouterr().out
    torch.manual_seed(0)
    zeroed = Spiky(zero_at_spike=True)  # that batch's gradients are zero: SGD does not move
    quiet_trainer(tmp_path, max_epochs=3).fit(zeroed, loader(32, batch_size=4))
    for a, b in zip(params(skipped), params(zeroed), strict=True):
        assert torch.equal(a, b)


def test_spike_window_resumes_exactly(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt: Any = None, root: Path = tmp_path) -> tuple[Spiky, torchrig.SpikeDetection]:
        torch.manual_seed(0)
        module, spikes = Spiky(), torchrig.SpikeDetection(on_spike="skip", window=4, rtol=RTOL)
        checkpointed_fit(root, module, [spikes], loader(32, batch_size=4, shuffle=True), max_steps=max_steps, ckpt=ckpt)
        return module, spikes

    whole, first = fit(-1, root=tmp_path / "a")
    fit(10, root=tmp_path / "b")  # stops at batch 2 of epoch 1, before the spike
    resumed, spikes = fit(-1, ckpt="last", root=tmp_path / "b")
    assert first.bad_batches == spikes.bad_batches == [4, 5]
    assert first.state_dict() == spikes.state_dict()
    for a, b in zip(params(whole), params(resumed), strict=True):
        assert torch.equal(a, b)


def test_spike_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("SpikeDetection(mode='low'); use 'min' or 'max'")):
        torchrig.SpikeDetection(mode="low")
    with pytest.raises(ValueError, match=re.escape("SpikeDetection(on_spike='ignore'); use 'raise'")):
        torchrig.SpikeDetection(on_spike="ignore")
    trainer = quiet_trainer(
        tmp_path, max_epochs=1, accumulate_grad_batches=2, callbacks=[torchrig.SpikeDetection(on_spike="skip")]
    )
    msg = "SpikeDetection(on_spike='skip') skips one batch's optimizer step, but accumulate_grad_batches=2"
    with pytest.raises(ValueError, match=re.escape(msg)):
        trainer.fit(Spiky(), loader(8))


DDP_SCRIPT = r"""
import sys
from pathlib import Path
import torch
import torchrig
from trainer_helpers import loader
from test_spike_detection import RTOL, Spiky

class OnlyRankOne(Spiky):
    def setup(self, stage):  # the loss spikes on rank 1 only
        self.factor = 50.0 if self.trainer.global_rank == 1 else 1.0

folder = Path(sys.argv[1])
torch.manual_seed(0)
module, spikes = OnlyRankOne(), torchrig.SpikeDetection(on_spike="skip", rtol=RTOL)
trainer = torchrig.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
                           enable_checkpointing=False, max_epochs=2, default_root_dir=folder, callbacks=[spikes])
trainer.fit(module, loader(64, batch_size=4))
state = {"bad": spikes.bad_batches, "weights": [p.detach() for p in module.parameters()]}
torch.save(state, folder / f"rank{trainer.global_rank}.pt")
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_spike_on_one_process_skips_the_step_on_every_process(tmp_path: Path) -> None:
    run_script(tmp_path, DDP_SCRIPT, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    bad = ranks[0]["bad"]
    assert bad == ranks[1]["bad"] and bad[-2:] == [4, 5]  # decided together (and rank 1's spike is in)
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert torch.equal(a, b)  # both skipped the steps: the replicas stay equal
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == bad
