"""``torchrig demo --resume`` with a longer horizon: the schedule is re-planned, the settings are kept."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchrig.demo.model import DigitsCNN, cosine_factor

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


def test_the_rate_is_a_function_of_the_epoch_and_the_current_horizon() -> None:
    model = DigitsCNN(width=2, lr=0.01)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)  # no scheduler whose state a checkpoint would freeze
    for epoch, horizon, factor in ((3, 3, 0.0), (3, 6, 0.5), (0, 6, 1.0), (40, -1, 1.0)):
        model._trainer = SimpleNamespace(current_epoch=epoch, max_epochs=horizon, optimizers=[optimizer])  # type: ignore[assignment]
        optimizer.param_groups[0]["lr"] = 123.0  # what a checkpoint restored: never used
        model.on_train_epoch_start()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * factor, abs=1e-12), (epoch, horizon)
    optimizer.param_groups[0]["lr"] = 0.0  # resumed mid-epoch (after Ctrl-C): no epoch start comes first
    model._trainer = SimpleNamespace(current_epoch=3, max_epochs=6, optimizers=[optimizer])  # type: ignore[assignment]
    model.on_train_start()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    assert cosine_factor(10**6, -1) == 1.0 and cosine_factor(2, None) == 1.0  # no end: the peak, never 0


@pytest.mark.timeout(120)
def test_resume_with_more_epochs_trains_the_next_epoch_and_keeps_the_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrig.demo.run import run_demo

    seen: dict[int, tuple[float, torch.Tensor, torch.Tensor]] = {}  # epoch: (lr, weights before, after)
    start, end = DigitsCNN.on_train_epoch_start, DigitsCNN.on_train_epoch_end

    def record_start(self: DigitsCNN) -> None:
        start(self)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        seen[self.trainer.current_epoch] = (lr, self.head.weight.detach().clone(), torch.empty(0))

    def record_end(self: DigitsCNN) -> None:
        end(self)
        lr, before, _ = seen[self.trainer.current_epoch]
        seen[self.trainer.current_epoch] = (lr, before, self.head.weight.detach().clone())

    monkeypatch.setattr(DigitsCNN, "on_train_epoch_start", record_start)
    monkeypatch.setattr(DigitsCNN, "on_train_epoch_end", record_end)
    common = {"accelerator": "cpu", "root_dir": tmp_path, "plot": False}

    first = run_demo(max_epochs=3, precision="bf16-mixed", **common)  # type: ignore[arg-type]
    assert first is not None and first.precision == "bf16-mixed"
    last = first.run_dir / "checkpoints" / "last"
    assert last.resolve().name == "epoch=2-step=60"  # 3 epochs: index 2, as the Trainer names it
    capsys.readouterr()
    resumed = run_demo(max_epochs=6, resume=True, **common)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert resumed is not None and (resumed.first_epoch, resumed.epochs) == (3, 6)
    assert resumed.precision == "bf16-mixed"  # the run's precision, not auto's 32-true
    assert "--resume continues with" not in out  # nothing changed
    assert last.resolve().name == "epoch=5-step=120"

    lr, before, after = seen[3]  # epoch 3/5 (counted from 0, as the checkpoint names)
    assert lr == pytest.approx(5e-3 * cosine_factor(3, 6)) and lr > 1e-3
    assert not torch.equal(before, after)  # it trained
    assert seen[2][0] == pytest.approx(5e-3 * cosine_factor(2, 3))  # the first run's own schedule
    assert f"torchrig demo: resumed after 3 epochs (step 60); epoch 3/5 starts at learning rate {lr:.3g}" in out

    again = run_demo(max_epochs=7, resume=True, precision="32-true", **common)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert again is not None and again.precision == "32-true"  # asked for: used, and said
    assert "torchrig demo: --resume continues with precision 32-true (the checkpoint was saved with bf16-mixed)" in out
