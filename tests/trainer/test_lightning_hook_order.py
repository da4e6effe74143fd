"""The same hook-recording module and callback under Lightning 2.6's Trainer and under torchrig's:
every hook, in the same order, for fit (with and without validation, with accumulation, with
manual optimization), validate, test and predict."""

from __future__ import annotations

from typing import Any

import pytest
from hook_recording import LOADERS, callback_hook_names, module_hook_names, quiet_lightning, recorder
from trainer_helpers import quiet_trainer

import torchrig

pl = pytest.importorskip("lightning.pytorch")

#: torchrig calls optimizer_step after the batch's forward and backward (Lightning: around them,
#: through the closure): compared apart.
SKIPPED = {"optimizer_step"}

SETTINGS: dict[str, dict[str, Any]] = {
    "fit": {"limit_train_batches": 2, "limit_val_batches": 1, "num_sanity_val_steps": 1},
    "fit-no-validation": {"limit_train_batches": 2, "limit_val_batches": 0, "num_sanity_val_steps": 1},
    "fit-accumulation": {
        "limit_train_batches": 2,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 1,
        "accumulate_grad_batches": 2,
    },
    "fit-manual": {"limit_train_batches": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0},
}


def _names() -> tuple[list[str], list[str]]:
    names = [n for n in module_hook_names(pl.LightningModule) if n not in SKIPPED]
    return names, callback_hook_names(pl.Callback)


def _run(framework: str, stage: str, settings: dict[str, Any], tmp_path: Any, record_steps: bool = False) -> list[str]:
    names, cb_names = _names()
    names = [*names, "optimizer_step"] if record_steps else names
    manual = stage == "fit-manual"
    if framework == "lightning":
        quiet_lightning()
        module, callback, log = recorder(pl.LightningModule, pl.Callback, names, cb_names, manual)
        trainer: Any = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            **settings,
        )
    else:
        module, callback, log = recorder(torchrig.TrainingModule, torchrig.Callback, names, cb_names, manual)
        trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[callback], enable_model_summary=False, **settings)
    if stage.startswith("fit"):
        trainer.fit(module)
    else:
        getattr(trainer, stage)(module)
    return log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [*SETTINGS, "validate", "test", "predict"])
def test_hooks_are_called_in_lightnings_order(stage: str, tmp_path: Any) -> None:
    settings = SETTINGS.get(stage, {})
    theirs = _run("lightning", stage, settings, tmp_path / "pl")
    ours = _run("torchrig", stage, settings, tmp_path / "rig")
    # Every hook of either side is recorded: the comparison cannot pass by recording nothing.
    assert "cb.setup" in theirs and "teardown" in theirs and len(theirs) > 20
    assert [h for h in ours if h not in LOADERS] == [h for h in theirs if h not in LOADERS]
    # optimizer_step: in both once per optimizer step; in torchrig right after the clipping.
    theirs_steps = _run("lightning", stage, settings, tmp_path / "pl2", record_steps=True)
    ours_steps = _run("torchrig", stage, settings, tmp_path / "rig2", record_steps=True)
    assert ours_steps.count("optimizer_step") == theirs_steps.count("optimizer_step")
    for i, name in enumerate(ours_steps):
        if name == "optimizer_step":
            assert ours_steps[i - 1] == "configure_gradient_clipping"


@pytest.mark.timeout(60)
def test_the_modules_own_loaders_are_asked_for_before_on_fit_start(tmp_path: Any) -> None:
    names, cb_names = _names()
    module, callback, log = recorder(torchrig.TrainingModule, torchrig.Callback, names, cb_names)
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[callback], limit_train_batches=2)
    trainer.fit(module)
    start = log.index("configure_optimizers")
    assert log[start : start + 4] == ["configure_optimizers", "train_dataloader", "val_dataloader", "cb.on_fit_start"]
    assert trainer.global_step == 2
    assert "test_loss" in trainer.test(module)[0]
    assert log.count("test_dataloader") == 1
