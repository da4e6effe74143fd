"""One module that logs with every ``self.log`` option, run under Lightning 2.6's Trainer and
under torchrig's with the same seed: what callbacks read in ``trainer.callback_metrics`` at each
hook, ``logged_metrics`` and ``progress_bar_metrics`` after the run, what ``on_train_batch_end``
and ``on_validation_batch_end`` get, ``dataloader_idx`` in every step, and what
``validate``/``test`` return, with one loader and with several."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hook_recording import linear_module, quiet_lightning, sum_data
from torch.utils.data import DataLoader
from trainer_helpers import quiet_trainer

import torchrig

pl = pytest.importorskip("lightning.pytorch")

#: (name, self.log options) logged in training_step
TRAIN_LOGS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("step_only", {"on_step": True, "on_epoch": False}),
    ("epoch_only", {"on_step": False, "on_epoch": True}),
    ("both", {"on_step": True, "on_epoch": True, "prog_bar": True}),
    ("hidden", {"on_step": True, "on_epoch": True, "logger": False}),
    ("largest", {"on_epoch": True, "reduce_fx": "max"}),
    ("total", {"on_step": False, "on_epoch": True, "reduce_fx": "sum"}),
    ("smallest", {"on_step": False, "on_epoch": True, "reduce_fx": torch.min}),
]
#: logged in validation_step (each loader's value shifted by its index)
VAL_LOGS: list[tuple[str, dict[str, Any]]] = [
    ("val_plain", {}),
    ("val_both", {"on_step": True}),
    ("val_bar", {"prog_bar": True}),
    ("val_max", {"reduce_fx": "max"}),
    ("val_sum", {"reduce_fx": torch.sum, "sync_dist": True}),
]


def rounded(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return round(float(value.detach()), 5) if value.numel() == 1 else tuple(value.shape)
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def classes(module_base: type, callback_base: type, skip_at: int | None = None) -> tuple[type, type, list[Any]]:
    """The logging module and a callback that records what it sees, on either framework's bases."""
    seen: list[Any] = []

    def note(trainer: Any, *what: Any) -> None:
        seen.append((*what, trainer.global_step, trainer.current_epoch))

    class Module(linear_module(module_base)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            where = (self.global_step, self.current_epoch, self.global_rank, self.local_rank)
            note(self.trainer, "module sees", where, self.logger is None, len(self.loggers))
            for name, options in TRAIN_LOGS:
                self.log(name, loss, **options)
            return loss

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
            loss = self.loss(batch)
            note(self.trainer, "validation_step", batch_idx, dataloader_idx)
            for name, options in VAL_LOGS:
                self.log(name, loss + dataloader_idx, **options)
            return {"val": loss}

        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            note(self.trainer, "test_step", batch_idx, dataloader_idx)
            self.log("test_loss", self.loss(batch) + dataloader_idx, on_step=True)

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            note(self.trainer, "predict_step", batch_idx, dataloader_idx)
            return self.layer(batch[0])

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            # -1 skips the rest of the epoch (Lightning's contract)
            return -1 if (self.trainer.current_epoch, batch_idx) == (0, skip_at) else None

        def on_train_epoch_end(self) -> None:
            self.log("module_epoch_end", float(self.trainer.current_epoch + 1))

        def on_validation_epoch_end(self) -> None:
            self.log("val_epoch_end", float(self.trainer.current_epoch + 10))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Recorder(callback_base):  # type: ignore[misc,valid-type]
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            note(trainer, "on_train_batch_end", batch_idx, rounded(outputs), rounded(trainer.callback_metrics))

        def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            note(trainer, "on_validation_batch_end", rounded(outputs), *args[1:])

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            note(trainer, "on_validation_end", rounded(trainer.callback_metrics))

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            note(trainer, "on_train_epoch_end", rounded(trainer.callback_metrics))

    return Module, Recorder, seen


def data(n: int = 18, seed: int = 0) -> DataLoader[Any]:
    """Batches of 4 and a last one of 2: epoch means weighted by each batch's size, as Lightning's."""
    return sum_data(n, seed)


def run(
    framework: str, stage: str, tmp_path: Any, loaders: int, skip_at: int | None = None, **settings: Any
) -> dict[str, Any]:
    torch.manual_seed(0)
    common = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    common |= {"enable_model_summary": False, "default_root_dir": tmp_path / framework, **settings}
    if framework == "lightning":
        quiet_lightning()
        module_cls, recorder_cls, seen = classes(pl.LightningModule, pl.Callback, skip_at)
        trainer: Any = pl.Trainer(accelerator="cpu", callbacks=[recorder_cls()], **common)
    else:
        module_cls, recorder_cls, seen = classes(torchrig.TrainingModule, torchrig.Callback, skip_at)
        trainer = torchrig.Trainer(accelerator="cpu", devices=1, callbacks=[recorder_cls()], **common)
    module = module_cls()
    evaluation = [data(10, seed=1 + i) for i in range(loaders)]
    evaluation_arg = evaluation[0] if loaders == 1 else evaluation
    if stage == "fit":
        result = trainer.fit(module, data(), evaluation_arg)
    else:
        result = getattr(trainer, stage)(module, evaluation_arg)
    return {
        "seen": seen,
        "result": rounded(result),
        "callback_metrics": rounded(dict(trainer.callback_metrics)),
        "logged_metrics": rounded(dict(trainer.logged_metrics)),
        "progress_bar_metrics": rounded(dict(trainer.progress_bar_metrics)),
    }


def assert_same(theirs: dict[str, Any], ours: dict[str, Any]) -> None:
    for key in ("callback_metrics", "logged_metrics", "progress_bar_metrics", "result"):
        assert ours[key] == theirs[key], key
    for i, (mine, other) in enumerate(zip(ours["seen"], theirs["seen"], strict=True)):
        assert mine == other, f"hook call {i}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loaders", [1, 2])
@pytest.mark.parametrize(
    "settings",
    [
        {"max_epochs": 2, "num_sanity_val_steps": 0},
        {"max_epochs": 1, "num_sanity_val_steps": 2, "val_check_interval": 2},
        {"max_steps": 3, "accumulate_grad_batches": 1, "num_sanity_val_steps": 0, "val_check_interval": 0.5},
    ],
    ids=["epochs", "sanity-int-interval", "max-steps-float-interval"],
)
def test_fit_logs_and_passes_what_lightning_does(tmp_path: Any, settings: dict[str, Any], loaders: int) -> None:
    theirs = run("lightning", "fit", tmp_path, loaders, **settings)
    ours = run("torchrig", "fit", tmp_path, loaders, **settings)
    assert len(theirs["seen"]) > 8 and "both" in theirs["callback_metrics"]  # the runs did record
    if loaders == 2 and settings.get("num_sanity_val_steps"):
        # Lightning's callback_metrics are empty at the sanity check's end with several loaders
        # (with one, they hold its values): torchrig shows them in both cases.
        keep = [i for i, s in enumerate(theirs["seen"]) if not (s[0] == "on_validation_end" and s[-2] == 0)]
        theirs["seen"] = [theirs["seen"][i] for i in keep]
        ours["seen"] = [ours["seen"][i] for i in keep]
    assert_same(theirs, ours)
    # the defects this holds torchrig to (each failed before): a monitor of a name logged per step
    # and per epoch reads the epoch's mean; on_train_batch_end gets {"loss": ...}
    assert ours["callback_metrics"]["both"] == ours["callback_metrics"]["both_epoch"]
    assert any(s[0] == "on_train_batch_end" and set(s[2]) == {"loss"} for s in ours["seen"])


@pytest.mark.timeout(60)
def test_on_train_batch_start_returning_minus_one_skips_the_rest_of_the_epoch(tmp_path: Any) -> None:
    theirs = run("lightning", "fit", tmp_path, 1, skip_at=2, max_epochs=2, num_sanity_val_steps=0)
    ours = run("torchrig", "fit", tmp_path, 1, skip_at=2, max_epochs=2, num_sanity_val_steps=0)
    assert_same(theirs, ours)
    trained = [s[1] for s in ours["seen"] if s[0] == "on_train_batch_end"]
    assert trained == [0, 1, 0, 1, 2, 3, 4]  # epoch 0 stopped before its batch 2; epoch 1 whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loaders", [1, 2])
@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_logs_and_passes_what_lightning_does(tmp_path: Any, stage: str, loaders: int) -> None:
    theirs = run("lightning", stage, tmp_path, loaders)
    ours = run("torchrig", stage, tmp_path, loaders)
    assert_same(theirs, ours)
    steps = [s for s in ours["seen"] if s[0].endswith("_step")]
    assert {s[2] for s in steps} == set(range(loaders))  # dataloader_idx reached every step


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"reduce_fx": "median"}, "self.log('x', reduce_fx='median'): torchrig reduces with 'mean', 'sum', 'max'"),
        ({"enable_graph": True}, "self.log('x', enable_graph=True) is not supported by torchrig: values are kept"),
        ({"sync_dist_group": 1}, "self.log('x', sync_dist_group=1) is not supported by torchrig: sync_dist reduces"),
        ({"add_dataloader_idx": False}, "self.log('x', add_dataloader_idx=False) is not supported by torchrig"),
        ({"metric_attribute": "acc"}, "self.log('x', metric_attribute='acc') is not supported by torchrig: log a"),
        ({"rank_zero_only": True, "sync_dist": True}, "a value logged on rank 0 only cannot be reduced across"),
    ],
)
def test_lightnings_log_arguments_torchrig_does_not_do_are_refused(
    tmp_path: Any, options: dict[str, Any], message: str
) -> None:
    class Logs(linear_module(torchrig.TrainingModule)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("x", loss, **options)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_model_summary=False)
    with pytest.raises(ValueError) as info:
        trainer.fit(Logs(), data())
    assert message in str(info.value)


def test_the_batch_size_is_inferred_from_the_first_tensor_and_said_when_it_cannot_be() -> None:
    from torchrig.trainer.metrics import MetricStore
    from torchrig.trainer.run import LogSink

    sink = LogSink(MetricStore(device=torch.device("cpu")))
    assert sink.batch_size() == 1  # outside a batch (an epoch-end hook)
    sink.batch = {"ids": torch.zeros(3, 5, dtype=torch.long), "labels": [torch.zeros(3)]}
    assert sink.batch_size() == 3
    sink.batch = ["no", "tensors"]
    with pytest.warns(UserWarning, match="could not infer the batch size from a batch of type list"):
        assert sink.batch_size() == 1
    sink.batch = (torch.zeros(2, 4), torch.zeros(5))
    with pytest.warns(UserWarning, match="inferred the batch size 2 from the batch's first tensor, but its tensors"):
        assert sink.batch_size() == 2


def test_the_modules_lightning_helpers(tmp_path: Any) -> None:
    module = classes(torchrig.TrainingModule, torchrig.Callback)[0]()
    assert (module.global_step, module.current_epoch, module.global_rank, module.logger) == (0, 0, 0, None)
    module.freeze()
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    module.unfreeze()
    assert module.training and all(p.requires_grad for p in module.parameters())
    quiet_trainer(tmp_path, max_epochs=1).validate(module, sum_data(4))
    assert tuple(module.all_gather(torch.ones(2)).shape) == (1, 2)  # (world_size, *shape)
    with pytest.raises(ValueError, match=r"self.all_gather\(group='g'\): torchrig gathers from every process"):
        module.all_gather(torch.ones(2), group="g")
