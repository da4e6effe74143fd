"""The order of module hooks and callback events, asserted for a tiny fit, validate and predict."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig.trainer.callbacks import Callback, EventSchedule


class Recorder(Callback):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.log.append("cb.on_fit_start")

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self.log.append("cb.on_fit_end")

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.log.append("cb.on_train_epoch_start")

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log.append(f"cb.on_train_batch_end({batch_idx})")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.log.append("cb.on_train_epoch_end")

    def on_eval_start(self, trainer: Any, module: Any, stage: str) -> None:
        self.log.append(f"cb.on_eval_start({stage})")

    def on_eval_batch_end(self, trainer: Any, module: Any, stage: str, outputs: Any, batch: Any, i: int) -> None:
        self.log.append(f"cb.on_eval_batch_end({stage},{i})")

    def on_eval_end(self, trainer: Any, module: Any, stage: str) -> None:
        self.log.append(f"cb.on_eval_end({stage})")

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.log.append("cb.on_validation_end")


class Recorded(Regressor):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.calls = log

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup({stage})")

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown({stage})")

    def configure_optimizers(self) -> Any:
        self.calls.append("configure_optimizers")
        return super().configure_optimizers()

    def on_train_start(self) -> None:
        self.calls.append("on_train_start")

    def on_train_end(self) -> None:
        self.calls.append("on_train_end")

    def on_train_epoch_start(self) -> None:
        self.calls.append("on_train_epoch_start")

    def on_train_epoch_end(self) -> None:
        self.calls.append("on_train_epoch_end")

    def on_validation_epoch_end(self) -> None:
        self.calls.append("on_validation_epoch_end")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append(f"training_step({batch_idx})")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.calls.append(f"validation_step({batch_idx})")
        super().validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append(f"predict_step({batch_idx})")
        return super().predict_step(batch, batch_idx)


def _epoch(n: int) -> list[str]:
    return [
        "cb.on_train_epoch_start",
        "on_train_epoch_start",
        "training_step(0)",
        "cb.on_train_batch_end(0)",
        "training_step(1)",
        "cb.on_train_batch_end(1)",
        "cb.on_eval_start(validate)",
        "validation_step(0)",
        "cb.on_eval_batch_end(validate,0)",
        "on_validation_epoch_end",
        "cb.on_eval_end(validate)",
        "cb.on_validation_end",
        "cb.on_train_epoch_end",
        "on_train_epoch_end",
    ]


@pytest.mark.timeout(20)
def test_fit_calls_torchrigs_own_eval_events_among_lightnings(tmp_path: Any) -> None:
    """torchrig's on_eval_* events where docs/migrating.md puts them: on_eval_start after
    on_validation_start, on_eval_batch_end after the batch's step, on_eval_end once the metrics
    are reduced, before on_validation_end (Lightning's own order: test_lightning_hook_order.py)."""
    log: list[str] = []
    trainer = quiet_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=1, callbacks=[Recorder(log)])
    trainer.fit(Recorded(log), loader(8, batch_size=4), loader(4, batch_size=4))
    expected = [
        "setup(fit)",
        "configure_optimizers",
        "cb.on_fit_start",
        "cb.on_eval_start(sanity_check)",
        "validation_step(0)",
        "cb.on_eval_batch_end(sanity_check,0)",
        "on_validation_epoch_end",
        "cb.on_eval_end(sanity_check)",
        "cb.on_validation_end",
        "on_train_start",
        *_epoch(0),
        *_epoch(1),
        "on_train_end",
        "cb.on_fit_end",
        "teardown(fit)",
    ]
    assert log == expected
    assert trainer.current_epoch == 2 and trainer.global_step == 4


class Sparse(Callback):
    """Asks for on_train_batch_end at most every ``interval`` seconds; records the batches it saw."""

    def __init__(self, interval: float, stop_after: tuple[int, int] | None = None) -> None:
        self.interval, self.stop_after = interval, stop_after
        self.seen: list[tuple[int, int, float]] = []

    def event_schedule(self, event: str) -> EventSchedule:
        return EventSchedule(seconds=self.interval) if event == "on_train_batch_end" else EventSchedule()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((trainer.current_epoch, batch_idx, float(outputs["loss"])))


class StopAfter(Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        self.at = (epoch, batch)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == self.at:
            trainer.should_stop = True


@pytest.mark.timeout(20)
def test_sparse_batch_end_sees_the_first_batch_then_the_last_of_each_epoch_and_the_stop(tmp_path: Any) -> None:
    # A callback that only shows progress asks for on_train_batch_end at most every hour: the
    # Trainer calls it for the run's first batch, for the last batch of every epoch, and for the
    # batch after which the fit stops, with that batch's loss; every-batch callbacks are unchanged.
    log: list[str] = []
    sparse, every = Sparse(3600.0), Recorder(log)
    trainer = quiet_trainer(tmp_path / "epochs", max_epochs=3, callbacks=[sparse, every])
    trainer.fit(Regressor(), loader(16, batch_size=4))
    assert [(e, b) for e, b, _ in sparse.seen] == [(0, 0), (0, 3), (1, 3), (2, 3)]
    assert sum(entry.startswith("cb.on_train_batch_end") for entry in log) == 12
    assert all(loss > 0 for _, _, loss in sparse.seen)

    sparse = Sparse(3600.0)  # max_steps ends the fit after epoch 1's batch 1
    quiet_trainer(tmp_path / "steps", max_steps=6, callbacks=[sparse]).fit(Regressor(), loader(16, batch_size=4))
    assert [(e, b) for e, b, _ in sparse.seen] == [(0, 0), (0, 3), (1, 1)]
    sparse = Sparse(3600.0)  # a callback stops it after epoch 1's batch 2
    trainer = quiet_trainer(tmp_path / "stop", max_epochs=3, callbacks=[sparse, StopAfter(1, 2)])
    trainer.fit(Regressor(), loader(16, batch_size=4))
    assert [(e, b) for e, b, _ in sparse.seen] == [(0, 0), (0, 3), (1, 2)]

    sparse = Sparse(0.0)  # no wait: every batch
    quiet_trainer(tmp_path / "all", max_epochs=2, callbacks=[sparse]).fit(Regressor(), loader(16, batch_size=4))
    assert [(e, b) for e, b, _ in sparse.seen] == [(e, b) for e in range(2) for b in range(4)]


class Quiet(Callback):
    """Overrides on_train_batch_end and on_train_epoch_end but wants only the epoch ends."""

    def __init__(self) -> None:
        self.batches, self.epochs = 0, 0

    def event_schedule(self, event: str) -> EventSchedule:
        return EventSchedule(enabled=False) if event == "on_train_batch_end" else EventSchedule()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.epochs += 1


@pytest.mark.timeout(20)
def test_a_callback_can_say_it_wants_an_event_not_at_all(tmp_path: Any) -> None:
    quiet = Quiet()
    quiet_trainer(tmp_path, max_epochs=2, callbacks=[quiet]).fit(Regressor(), loader(16, batch_size=4))
    assert (quiet.batches, quiet.epochs) == (0, 2)
    # ModelCheckpoint saving at epoch ends asks the same; saving every n steps it wants every batch end.
    assert torchrig.ModelCheckpoint().event_schedule("on_train_batch_end") == EventSchedule(enabled=False)
    assert torchrig.ModelCheckpoint(every_n_train_steps=2).event_schedule("on_train_batch_end") == EventSchedule()


class SecondsOnEpochEnd(Callback):
    def event_schedule(self, event: str) -> EventSchedule:
        return EventSchedule(seconds=1.0)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None: ...


@pytest.mark.timeout(20)
def test_event_schedule_refuses_what_the_trainer_cannot_do(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"EventSchedule\(seconds=-1\): give a number of seconds >= 0"):
        EventSchedule(seconds=-1)
    with pytest.raises(ValueError, match=r"EventSchedule\(enabled=1\) must be True or False"):
        EventSchedule(enabled=1)  # type: ignore[arg-type]
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[SecondsOnEpochEnd()])
    with pytest.raises(
        ValueError,
        match=r"SecondsOnEpochEnd.event_schedule\('on_train_epoch_end'\) returned "
        r"seconds=1.0; only on_train_batch_end can be called at most every so many seconds",
    ):
        trainer.fit(Regressor(), loader(16, batch_size=4))


@pytest.mark.timeout(20)
def test_validate_and_predict_call_their_hooks(tmp_path: Any) -> None:
    log: list[str] = []
    trainer = quiet_trainer(tmp_path, callbacks=[Recorder(log)])
    module = Recorded(log)
    trainer.validate(module, loader(8, batch_size=4))
    trainer.predict(module, loader(4, batch_size=4))
    assert log == [
        "setup(validate)",
        "cb.on_eval_start(validate)",
        "validation_step(0)",
        "cb.on_eval_batch_end(validate,0)",
        "validation_step(1)",
        "cb.on_eval_batch_end(validate,1)",
        "on_validation_epoch_end",
        "cb.on_eval_end(validate)",
        "cb.on_validation_end",
        "teardown(validate)",
        "setup(predict)",
        "cb.on_eval_start(predict)",
        "predict_step(0)",
        "cb.on_eval_batch_end(predict,0)",
        "cb.on_eval_end(predict)",
        "teardown(predict)",
    ]


@pytest.mark.timeout(20)
def test_steps_run_through_the_prepared_module_under_autocast(tmp_path: Any) -> None:
    dtypes: list[torch.dtype] = []

    class Probe(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self(batch[0])
            dtypes.append(out.dtype)
            return torch.nn.functional.mse_loss(out.float(), batch[1])

    trainer = quiet_trainer(tmp_path, max_steps=1, precision="bf16-mixed")
    trainer.fit(Probe(), loader(8))
    assert dtypes == [torch.bfloat16]  # autocast of the Rig's precision wraps training_step


@pytest.mark.timeout(20)
def test_module_knows_its_trainer_and_device(tmp_path: Any) -> None:
    module = Regressor()
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        _ = module.trainer
    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(module, loader(8))
    assert module.trainer is trainer
    assert module.device == torch.device("cpu")
    assert isinstance(trainer.rig, torchrig.Rig)
    clone = copy.deepcopy(module)  # a copy leaves the Trainer behind
    assert clone._trainer is None and all(
        torch.equal(a, b) for a, b in zip(clone.parameters(), module.parameters(), strict=True)
    )
