"""The Trainer steps through the Rig's public API, as a hand-written loop does (issue 19): what
a user wraps on the Rig or on a prepared optimizer sees every step."""

from __future__ import annotations

from typing import Any

import pytest
from trainer_helpers import Regressor, loader, quiet_trainer

from torchrig.trainer.callbacks import Callback


class CountCalls(Callback):
    """Wraps ``rig.backward`` and each prepared optimizer's ``step``/``zero_grad`` when the fit starts."""

    def __init__(self) -> None:
        self.calls = {"backward": 0, "step": 0, "zero_grad": 0}

    def counting(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return call

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        trainer.rig.backward = self.counting("backward", trainer.rig.backward)
        for opt in trainer.optimizers:
            opt.step = self.counting("step", opt.step)
            opt.zero_grad = self.counting("zero_grad", opt.zero_grad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_step_goes_through_rig_backward_and_the_prepared_optimizer(
    tmp_path: Any, precision: str, accumulate: int
) -> None:
    counter = CountCalls()
    trainer = quiet_trainer(
        tmp_path, max_epochs=2, precision=precision, accumulate_grad_batches=accumulate, callbacks=[counter]
    )
    trainer.fit(Regressor(), loader(16, batch_size=4))  # 4 batches an epoch
    steps = 2 * 4 // accumulate
    assert trainer.global_step == steps
    assert counter.calls == {"backward": 8, "step": steps, "zero_grad": steps}
