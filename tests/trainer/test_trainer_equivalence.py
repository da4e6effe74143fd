"""The Trainer computes what the same hand-written Rig loop computes (accumulation, clipping, schedulers)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig


def rig_loop(
    module: Regressor, *, epochs: int, accumulate: int, clip: float | None, algorithm: str, seed: int
) -> list[torch.Tensor]:
    """The loop a user writes with the Rig: the reference the Trainer must match."""
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    rig.seed_everything(seed)
    optimizer = torch.optim.SGD(module.parameters(), lr=module.lr, momentum=0.9)
    model, optimizer, data = rig.prepare(module, optimizer, loader(40, batch_size=4, shuffle=True))
    n = len(data)
    for _ in range(epochs):
        for i, (x, y) in enumerate(data):
            boundary = (i + 1) % accumulate == 0 or i + 1 == n
            with rig.no_backward_sync(model, enabled=not boundary):
                loss = torch.nn.functional.mse_loss(model(x), y)
                rig.backward(loss / accumulate if accumulate > 1 else loss)
            if boundary:
                if clip is not None:
                    kind = {"max_norm": clip} if algorithm == "norm" else {"clip_val": clip}
                    rig.clip_gradients(model, optimizer, **kind)
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach() for p in module.parameters()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("accumulate", "clip", "algorithm"), [(1, None, "norm"), (3, 0.5, "norm"), (4, 0.05, "value")])
def test_accumulation_and_clipping_match_the_rig_loop(
    tmp_path: Any, accumulate: int, clip: float | None, algorithm: str
) -> None:
    torch.manual_seed(1)
    start = Regressor()
    reference = rig_loop(copy.deepcopy(start), epochs=2, accumulate=accumulate, clip=clip, algorithm=algorithm, seed=7)
    module = copy.deepcopy(start)
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=2,
        seed=7,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
    )
    trainer.fit(module, loader(40, batch_size=4, shuffle=True))
    got = [p.detach() for p in module.parameters()]
    assert trainer.global_step == 2 * -(-10 // accumulate)  # a partial window steps at the epoch's end
    assert all(torch.allclose(a, b) for a, b in zip(got, reference, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(got, list(start.parameters()), strict=True))


class Scheduled(Regressor):
    def __init__(self, interval: str) -> None:
        super().__init__(lr=0.1)
        self.interval = interval

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("interval", "expected_steps"), [("step", 6), ("epoch", 2)])
def test_schedulers_step_per_interval(tmp_path: Any, interval: str, expected_steps: int) -> None:
    module = Scheduled(interval)
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[torchrig.LearningRateMonitor()])
    trainer.fit(module, loader(12, batch_size=4))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**expected_steps)


class Plateau(Regressor):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", 1.0)  # never improves after the first epoch


@pytest.mark.timeout(20)
def test_reduce_on_plateau_reads_the_monitored_metric(tmp_path: Any) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=3)
    trainer.fit(Plateau(), loader(8), loader(4))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


@pytest.mark.timeout(20)
def test_configure_optimizers_shapes_are_checked(tmp_path: Any) -> None:
    class Bad(Regressor):
        def configure_optimizers(self) -> Any:
            return "sgd"

    with pytest.raises(TypeError, match=r"configure_optimizers\(\) returned str: return an optimizer"):
        quiet_trainer(tmp_path, max_steps=1).fit(Bad(), loader(8))

    class NoMonitor(Regressor):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}

    with pytest.raises(ValueError, match="ReduceLROnPlateau needs the metric it watches"):
        quiet_trainer(tmp_path, max_steps=1).fit(NoMonitor(), loader(8))

    class Lists(Regressor):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]

    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(Lists(), loader(8))
    assert len(trainer.optimizers) == 1 and trainer.lr_scheduler_configs[0].interval == "epoch"
