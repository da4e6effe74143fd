"""``on_save_checkpoint``/``on_load_checkpoint`` under Lightning 2.6's Trainer and under
torchrig's: what the module and a callback add to a checkpoint comes back to them when a fit
resumes from it, and to the module's ``on_load_checkpoint`` in ``load_from_checkpoint``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hook_recording import linear_module, quiet_lightning, sum_data

import torchrig

pl = pytest.importorskip("lightning.pytorch")


def classes(module_base: type, callback_base: type, seen: list[Any]) -> tuple[type, type]:
    class Extras(callback_base):  # type: ignore[misc,valid-type]
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            checkpoint["callback_extra"] = 5

        def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            seen.append(("callback", checkpoint.get("module_extra"), checkpoint.get("callback_extra")))

    class Module(linear_module(module_base)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["module_extra"] = {"vocabulary": ["a", "b"]}

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            seen.append(("module", checkpoint.get("module_extra"), checkpoint.get("callback_extra")))

    return Module, Extras


def run(framework: str, tmp_path: Path) -> list[Any]:
    seen: list[Any] = []
    common = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    common |= {"enable_model_summary": False, "default_root_dir": tmp_path / framework}
    if framework == "lightning":
        quiet_lightning()
        module_cls, callback_cls = classes(pl.LightningModule, pl.Callback, seen)
        trainer_cls: Any = pl.Trainer
        path = tmp_path / framework / "saved.ckpt"
    else:
        module_cls, callback_cls = classes(torchrig.TrainingModule, torchrig.Callback, seen)
        trainer_cls, path = torchrig.Trainer, tmp_path / framework / "saved"
    trainer = trainer_cls(max_epochs=1, callbacks=[callback_cls()], **common)
    trainer.fit(module_cls(), sum_data())
    trainer.save_checkpoint(path)
    trainer_cls(max_epochs=2, callbacks=[callback_cls()], **common).fit(module_cls(), sum_data(), ckpt_path=path)
    seen.append("load_from_checkpoint")
    module_cls.load_from_checkpoint(path)
    return seen


@pytest.mark.timeout(60)
def test_what_the_checkpoint_hooks_add_comes_back_as_under_lightning(tmp_path: Path) -> None:
    theirs, ours = run("lightning", tmp_path), run("torchrig", tmp_path)
    # The resume's calls in any order (Lightning calls the module's first, torchrig the callbacks'),
    # then load_from_checkpoint's, which failed before: the module's hook was not called there.
    assert sorted(map(str, ours[:2])) == sorted(map(str, theirs[:2]))
    assert ours[2:] == theirs[2:] == ["load_from_checkpoint", ("module", {"vocabulary": ["a", "b"]}, 5)]
