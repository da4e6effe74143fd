"""ModelPruning: pruning as Lightning's callback does, masks that survive a resume, its errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import checkpointed_fit, lightning_trainer, loader, quiet_trainer

import torchrig


class NetSteps:
    """The model's steps, for torchrig's module and Lightning's alike."""

    a: torch.nn.Linear
    b: torch.nn.Linear

    def layers(self) -> None:
        self.a, self.b = torch.nn.Linear(4, 16), torch.nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)  # type: ignore[attr-defined]


class Net(NetSteps, torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers()


def lightning_weights(tmp_path: Path, start: dict[str, torch.Tensor], **pruning: Any) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelPruning

    class LNet(NetSteps, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers()

    model = LNet()
    model.load_state_dict(start)
    trainer = lightning_trainer(tmp_path, max_epochs=1, callbacks=[ModelPruning(**pruning)])
    trainer.fit(model, loader(32, batch_size=4))
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("global_unstructured", [True, False])
def test_pruning_trains_as_lightnings_model_pruning(tmp_path: Path, global_unstructured: bool) -> None:
    torch.manual_seed(0)
    module = Net()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    args = {
        "pruning_fn": "l1_unstructured",
        "amount": 0.3,
        "use_global_unstructured": global_unstructured,
        "use_lottery_ticket_hypothesis": False,
    }
    # One epoch, pruned once: later prunings rank the current weights, Lightning's those of the
    # last forward (one optimizer step older), so only the first is compared.
    quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.ModelPruning(**args)]).fit(
        module, loader(32, batch_size=4)
    )
    ours = module.state_dict()
    assert set(ours) == set(start)  # made permanent: plain weights again
    theirs = lightning_weights(tmp_path, start, **args)
    for k in start:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    pruned = sum(int((v == 0).sum()) for v in ours.values())
    total = sum(v.numel() for v in ours.values())
    assert pruned / total == pytest.approx(0.3, abs=0.05)


def test_pruning_masks_and_originals_survive_a_resume(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt: Any = None, root: Path = tmp_path) -> Net:
        torch.manual_seed(0)
        module = Net()
        pruning = torchrig.ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=False)
        checkpointed_fit(
            root, module, [pruning], loader(32, batch_size=4, shuffle=True), max_steps=max_steps, ckpt=ckpt
        )
        return module

    whole = fit(-1, root=tmp_path / "a")
    fit(10, root=tmp_path / "b")  # two steps into epoch 1, pruned once
    resumed = fit(-1, ckpt="last", root=tmp_path / "b")
    mask = whole.a.weight_mask
    assert 0 < int((mask == 0).sum()) < mask.numel()
    for (k, a), (k2, b) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k


def test_pruning_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=re.escape("ModelPruning(pruning_fn='l3'): use one of 'l1_unstructured'")):
        torchrig.ModelPruning("l3")
    msg = "use_global_unstructured=True prunes unstructured, but LnStructured is structured"
    with pytest.raises(ValueError, match=re.escape(msg)):
        torchrig.ModelPruning("ln_structured", pruning_dim=0, pruning_norm=2)
    with pytest.raises(ValueError, match=re.escape("ln_structured needs the norm; give pruning_norm=")):
        torchrig.ModelPruning("ln_structured", use_global_unstructured=False, pruning_dim=0)
    with pytest.raises(ValueError, match=re.escape("ModelPruning(amount=1.5): a float is a fraction in [0, 1]")):
        torchrig.ModelPruning(torch.nn.utils.prune.l1_unstructured, amount=1.5)


def test_pruning_refuses_a_module_outside_the_fit(tmp_path: Path) -> None:
    pruning = torchrig.ModelPruning("l1_unstructured", parameters_to_prune=[(torch.nn.Linear(2, 2), "weight")])
    msg = "ModelPruning(parameters_to_prune=[(Linear, 'weight'), ...]): that module is not part of Net"
    with pytest.raises(ValueError, match=re.escape(msg)):
        quiet_trainer(tmp_path, max_epochs=1, callbacks=[pruning]).fit(Net(), loader(8))


def test_pruning_refuses_to_resume_a_checkpoint_written_without_it(tmp_path: Path) -> None:
    saving = torchrig.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[saving]).fit(Net(), loader(8))
    pruning = torchrig.ModelPruning("l1_unstructured", amount=0.3)
    again = torchrig.ModelCheckpoint(dirpath=tmp_path / "ck")
    trainer = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[pruning, again])
    with pytest.raises(torchrig.CheckpointError, match=re.escape("has no entries ['ModelPruning.originals']")):
        trainer.fit(Net(), loader(8), ckpt_path="last")
