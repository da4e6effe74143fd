"""The overrides Lightning users write (optimizer_step, optimizer_zero_grad, lr_scheduler_step with
a timm-style scheduler, configure_gradient_clipping, configure_callbacks, backward), a dataclass
returned by training_step, and Trainer.fit(torch.compile(module))."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, params, quiet_trainer

import torchrig


class WarmupStep(Regressor):
    """Lightning's learning-rate warm-up recipe: scale the lr, then step with the closure."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.calls: list[tuple[int, int, float]] = []

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)
        self.calls.append((epoch, batch_idx, optimizer.param_groups[0]["lr"]))
        optimizer.step(closure=optimizer_closure)


class NoStep(Regressor):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()  # steps nothing: the weights stay


@pytest.mark.timeout(30)
def test_optimizer_step_replaces_the_step(tmp_path: Any) -> None:
    module = WarmupStep()
    quiet_trainer(tmp_path, max_epochs=2).fit(module, loader(16, batch_size=4))
    assert module.calls == [(e, b, 0.1 * min(1.0, (4 * e + b + 1) / 4)) for e in range(2) for b in range(4)]
    still = NoStep()
    before = params(still)
    quiet_trainer(tmp_path, max_epochs=1).fit(still, loader(8, batch_size=4))
    assert all(torch.equal(a, b) for a, b in zip(before, params(still), strict=True))


class KeepZeros(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.zeroed_at: list[tuple[int, int]] = []

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        self.zeroed_at.append((epoch, batch_idx))
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.timeout(30)
def test_optimizer_zero_grad_is_called_at_each_windows_first_batch(tmp_path: Any) -> None:
    module = KeepZeros()
    quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(module, loader(16, batch_size=4))
    assert module.zeroed_at == [(0, 0), (0, 2)]


class CosineLike:
    """Shaped like timm's CosineLRScheduler: not a torch scheduler; ``step(epoch, metric=None)``
    sets the learning rate of that epoch, ``state_dict``/``load_state_dict`` as timm's."""

    def __init__(self, optimizer: torch.optim.Optimizer, t_initial: int, lr_min: float = 0.0) -> None:
        self.optimizer, self.t_initial, self.lr_min = optimizer, t_initial, lr_min
        self.base = [g["lr"] for g in optimizer.param_groups]

    def step(self, epoch: int, metric: Any = None) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = self.lr_min + 0.5 * (base - self.lr_min) * (1 + math.cos(math.pi * epoch / self.t_initial))

    def state_dict(self) -> dict[str, Any]:
        return {"t_initial": self.t_initial}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t_initial = state["t_initial"]


class TimmScheduled(Regressor):
    def __init__(self, own_step: bool = True) -> None:
        super().__init__(lr=0.1)
        self.lrs: list[float] = []
        if own_step:
            self.lr_scheduler_step = self._step  # type: ignore[method-assign]

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": CosineLike(opt, t_initial=4), "interval": "epoch"}}

    def _step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step(epoch=self.trainer.current_epoch + 1)
        self.lrs.append(scheduler.optimizer.param_groups[0]["lr"])


@pytest.mark.timeout(30)
def test_lr_scheduler_step_steps_a_timm_style_scheduler(tmp_path: Any) -> None:
    module = TimmScheduled()
    quiet_trainer(tmp_path, max_epochs=3).fit(module, loader(8, batch_size=4))
    assert module.lrs == pytest.approx([0.05 * (1 + math.cos(math.pi * e / 4)) for e in (1, 2, 3)])
    with pytest.raises(
        TypeError,
        match=r"lr_scheduler CosineLike is not a torch LR scheduler; .* or define lr_scheduler_step\(self, "
        r"scheduler, metric\) on the module to step it yourself",
    ):
        quiet_trainer(tmp_path, max_epochs=1).fit(TimmScheduled(own_step=False), loader(8, batch_size=4))


class ClipsItself(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.clips: list[tuple[Any, Any]] = []

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.clips.append((gradient_clip_val, gradient_clip_algorithm))
        self.clip_gradients(optimizer, gradient_clip_val=0.0, gradient_clip_algorithm="value")  # no step moves


@pytest.mark.timeout(30)
def test_configure_gradient_clipping_runs_at_every_step_with_the_trainers_settings(tmp_path: Any) -> None:
    module = ClipsItself()
    before = params(module)
    quiet_trainer(tmp_path, max_epochs=1, gradient_clip_val=0.5).fit(module, loader(8, batch_size=4))
    assert module.clips == [(0.5, "norm")] * 2
    # Clipped to 0 each step: plain SGD with momentum moves nothing.
    assert all(torch.equal(a, b) for a, b in zip(before, params(module), strict=True))
    again = ClipsItself()
    quiet_trainer(tmp_path, max_epochs=1).fit(again, loader(8, batch_size=4))
    assert again.clips == [(None, "norm")] * 2  # also without gradient_clip_val, as in Lightning


class Counter(torchrig.Callback):
    def __init__(self, name: str) -> None:
        self.name, self.batches = name, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1


class BringsCallbacks(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.mine = Counter("module's")

    def configure_callbacks(self) -> Any:
        return self.mine


@pytest.mark.timeout(30)
def test_configure_callbacks_adds_and_replaces_for_the_run(tmp_path: Any) -> None:
    trainers = Counter("trainer's")
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[trainers])
    module = BringsCallbacks()
    trainer.fit(module, loader(8, batch_size=4))
    assert (module.mine.batches, trainers.batches) == (2, 0)  # the module's replaced the Trainer's of its type
    trainer.fit(Regressor(), loader(8, batch_size=4))
    assert (module.mine.batches, trainers.batches) == (2, 2)  # the next module's run has the Trainer's back


class OwnBackward(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.losses.append(float(loss))
        (2 * loss).backward()


@pytest.mark.timeout(30)
def test_backward_override_runs_each_batchs_backward(tmp_path: Any) -> None:
    mine, plain = OwnBackward(), Regressor()
    plain.load_state_dict(mine.state_dict())
    quiet_trainer(tmp_path, max_epochs=1).fit(mine, loader(8, batch_size=4))
    assert len(mine.losses) == 2
    # Twice the gradient is plain SGD with twice the learning rate.
    plain.lr = 2 * plain.lr
    quiet_trainer(tmp_path, max_epochs=1).fit(plain, loader(8, batch_size=4))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params(mine), params(plain), strict=True))


@dataclass
class StepOutput:
    loss: torch.Tensor
    size: int


class ReturnsDataclass(Regressor):
    def __init__(self, with_loss: bool = True) -> None:
        super().__init__()
        self.with_loss = with_loss
        self.seen: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return StepOutput(loss, len(batch[0])) if self.with_loss else {"size": 1}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(outputs)


@pytest.mark.timeout(30)
def test_training_step_may_return_a_dataclass_with_a_loss(tmp_path: Any) -> None:
    module, plain = ReturnsDataclass(), Regressor()
    plain.load_state_dict(module.state_dict())
    quiet_trainer(tmp_path, max_epochs=1).fit(module, loader(8, batch_size=4))
    quiet_trainer(tmp_path, max_epochs=1).fit(plain, loader(8, batch_size=4))
    assert [type(o) for o in module.seen] == [StepOutput, StepOutput]
    assert all(torch.equal(a, b) for a, b in zip(params(module), params(plain), strict=True))
    with pytest.raises(TypeError, match="training_step returned dict; return the loss tensor, a dict with a 'loss'"):
        quiet_trainer(tmp_path, max_epochs=1).fit(ReturnsDataclass(with_loss=False), loader(8, batch_size=4))


@pytest.mark.timeout(60)
def test_fit_takes_a_compiled_module(tmp_path: Any) -> None:
    module, plain = Regressor(), Regressor()
    plain.load_state_dict(module.state_dict())
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(torch.compile(module, backend="eager"), loader(8, batch_size=4))
    assert trainer.module is module and trainer.global_step == 2
    quiet_trainer(tmp_path, max_epochs=1).fit(plain, loader(8, batch_size=4))
    assert all(torch.allclose(a, b) for a, b in zip(params(module), params(plain), strict=True))
    assert "val_loss" in trainer.validate(torch.compile(module, backend="eager"), loader(4))[0]
