"""``BaseFinetuning`` and ``BackboneFinetuning``: Lightning's behaviour (compared with Lightning's
own callback on the same model and data), an exact resume with the parameter groups added mid-fit,
and the ``rig.load(..., prepare=)`` step the resume is built on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trainer_helpers import checkpointed_fit, fit_under_lightning_and_torchrig, loader, quiet_trainer, run_child

import torchrig
from torchrig.checkpoint import CheckpointError

# With train_bn=True the backbone's BatchNorm trains from the start, so it is in the optimizer when
# the backbone's group is added: skipped with a warning, as in Lightning (asserted below).
pytestmark = pytest.mark.filterwarnings("ignore:2 of the parameters to add")


def backbone_model(base: type) -> type:
    """A model with a ``backbone`` (BatchNorm inside) and a head, for Lightning's or torchrig's base."""

    class Model(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
            self.head = nn.Linear(8, 1)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.head(self.backbone(x)), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    return Model


Model = backbone_model(torchrig.TrainingModule)


class Plain(Model):
    """The model without BatchNorm (for FSDP: a BatchNorm's running statistics are each process's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone[1] = nn.Identity()


def fit(root: Path, max_steps: int = -1, ckpt: str | None = None, **finetuning: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    module = Model()
    callback = torchrig.BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5, **finetuning)
    train = loader(32, batch_size=8, shuffle=True)
    return checkpointed_fit(root, module, [callback], train, max_epochs=4, max_steps=max_steps, ckpt=ckpt), module


@pytest.mark.timeout(120)
def test_backbone_finetuning_trains_as_lightnings(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="(are|will be) skipped"):  # BatchNorm trains from the start
        runs = fit_under_lightning_and_torchrig(
            tmp_path,
            backbone_model,
            lambda cbs: cbs.BackboneFinetuning(
                unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, backbone_initial_lr=0.01
            ),
            lambda: loader(32, batch_size=8),
        )
    (theirs, theirs_trainer, theirs_cb), (ours, ours_trainer, ours_cb) = runs["lightning"], runs["torchrig"]
    assert len(ours.losses) == 16
    assert ours.losses == pytest.approx(theirs.losses, rel=1e-6)
    assert ours.losses[:4] != ours.losses[4:8]  # the backbone trains from epoch 1
    for key, value in theirs.state_dict().items():
        assert torch.allclose(ours.state_dict()[key], value, atol=1e-6), key
    lrs = [g["lr"] for g in ours_trainer.optimizers[0].param_groups]
    assert lrs == [g["lr"] for g in theirs_trainer.optimizers[0].param_groups]
    assert lrs == [0.05, pytest.approx(0.01 * 1.5 * 1.5)]  # grown at epochs 2 and 3
    assert ours_cb.previous_backbone_lr == theirs_cb.previous_backbone_lr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_at", [6, 9], ids=["mid_unfreeze_epoch", "mid_later_epoch"])
def test_backbone_finetuning_resumes_exactly(tmp_path: Path, stop_at: int) -> None:
    """Interrupted after the backbone's group was added (4 batches an epoch, unfrozen at epoch 1)
    and resumed: the same weights, optimizer groups and learning rates as one uninterrupted fit."""
    whole_trainer, whole = fit(tmp_path / "a")
    _, cut = fit(tmp_path / "b", max_steps=stop_at)
    assert not cut.backbone[0].weight.requires_grad or stop_at > 4
    resumed_trainer, resumed = fit(tmp_path / "b", ckpt="last")
    assert resumed_trainer.global_step == whole_trainer.global_step == 16
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    groups = [(g["lr"], len(g["params"])) for g in resumed_trainer.optimizers[0].param_groups]
    assert groups == [(g["lr"], len(g["params"])) for g in whole_trainer.optimizers[0].param_groups]
    assert groups == [(0.05, 4), (0.05 * 0.1 * 1.5 * 1.5, 2)]  # head and BatchNorm; the Linear, grown twice
    assert whole.losses[-7:] == resumed.losses[-7:]


def test_a_resume_restores_what_was_frozen(tmp_path: Path) -> None:
    """Saved before the backbone is unfrozen: it stays frozen (BatchNorm not tracking with
    train_bn=False) in the resumed fit until the epoch that unfreezes it."""
    fit(tmp_path, max_steps=2, train_bn=False)
    torch.manual_seed(0)
    module = Model()
    callback = torchrig.BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=False)
    seen = []

    class Look(torchrig.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            seen.append(
                (trainer.current_epoch, module.backbone[0].weight.requires_grad, module.backbone[1].track_running_stats)
            )

    trainer = quiet_trainer(tmp_path, max_epochs=2, enable_checkpointing=False, callbacks=[callback, Look()])
    trainer.fit(module, loader(32, batch_size=8, shuffle=True), ckpt_path=tmp_path / "ck" / "last")
    assert seen == [(0, False, False)] * 2 + [(1, True, True)] * 4


def test_backbone_finetuning_needs_a_backbone_and_sound_arguments(tmp_path: Path) -> None:
    from trainer_helpers import Regressor

    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.BackboneFinetuning()])
    with pytest.raises(ValueError, match=r"Regressor.backbone is nothing: set self.backbone = <the part"):
        trainer.fit(Regressor(), loader(8))
    with pytest.raises(ValueError, match="unfreeze_backbone_at_epoch"):
        torchrig.BackboneFinetuning(unfreeze_backbone_at_epoch=-1)
    with pytest.raises(TypeError, match=r"lambda_func=2\) must be callable"):
        torchrig.BackboneFinetuning(lambda_func=2)  # type: ignore[arg-type]


def test_base_finetuning_says_what_to_override(tmp_path: Path) -> None:
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.BaseFinetuning()])
    with pytest.raises(NotImplementedError, match=r"BaseFinetuning must override freeze_before_training\(pl_module\)"):
        trainer.fit(Model(), loader(8))


def test_adding_parameters_the_optimizer_has_warns_and_skips_them() -> None:
    module = Model()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"4 of the parameters to add are in a parameter group .* are skipped"):
        torchrig.BaseFinetuning.unfreeze_and_add_param_group(module.backbone, optimizer)
    assert len(optimizer.param_groups) == 1
    frozen = Model()
    torchrig.BaseFinetuning.freeze(frozen.backbone, train_bn=False)
    assert [p.requires_grad for p in frozen.backbone.parameters()] == [False] * 4
    optimizer = torch.optim.SGD(frozen.head.parameters(), lr=0.1)
    torchrig.BaseFinetuning.unfreeze_and_add_param_group(frozen.backbone, optimizer, initial_denom_lr=4.0)
    assert [(g["lr"], len(g["params"])) for g in optimizer.param_groups] == [(0.1, 2), (0.025, 4)]


def test_rig_load_prepare_shapes_the_objects_before_they_are_compared(tmp_path: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    saved = torch.optim.SGD(model[0].parameters(), lr=0.1)
    saved.add_param_group({"params": list(model[1].parameters()), "lr": 0.01})
    rig.save(tmp_path / "c", {"optimizer": saved, "epoch": 3})

    fresh = torch.optim.SGD(model[0].parameters(), lr=0.5)
    with pytest.raises(CheckpointError, match="2 parameter groups in the checkpoint, 1 in the optimizer"):
        rig.load(tmp_path / "c", {"optimizer": fresh})
    seen = []

    def prepare(values: dict[str, Any]) -> None:
        seen.append(values["epoch"])
        fresh.add_param_group({"params": list(model[1].parameters())})

    rig.load(tmp_path / "c", {"optimizer": fresh}, prepare=prepare)
    assert seen == [3]
    assert [g["lr"] for g in fresh.param_groups] == [0.1, 0.01]


TWO_PROCESSES = r"""
import json, sys
import torch
import torchrig
from test_lightning_finetuning import Plain
from trainer_helpers import loader

def run(max_steps, ckpt_path=None, seed=0):
    torch.manual_seed(seed)
    trainer = torchrig.Trainer(
        accelerator="cpu", devices=2, strategy=sys.argv[2], max_epochs=4, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=f"{sys.argv[1]}/{max_steps}{ckpt_path is None}",
        callbacks=[
            torchrig.BackboneFinetuning(1, lambda e: 1.5),
            torchrig.ModelCheckpoint(every_n_train_steps=1, save_last=True),
        ],
    )
    module = Plain()
    trainer.fit(module, loader(32, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.state_dict().items()}
    return trainer, full

trainer, straight = run(-1)
first, _ = run(6)
_, resumed = run(-1, ckpt_path=str(first.checkpoint_callback.resolve_dirpath(first) / "last"), seed=9)
if trainer.is_global_zero:
    sys.stdout.write(json.dumps({
        "groups": [len(g["params"]) for g in trainer.optimizers[0].param_groups],
        "weights": {k: v.tolist() for k, v in straight.items()},
        "resumed_equal": all(torch.equal(resumed[k], straight[k]) for k in straight),
    }) + "\n")
"""


def run_two(tmp_path: Path, strategy: str) -> subprocess.CompletedProcess[str]:
    return run_child(tmp_path, TWO_PROCESSES, str(tmp_path / "root"), strategy)


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_fsdp_two_processes_train_as_one_and_resume_exactly(tmp_path: Path) -> None:
    done = run_two(tmp_path, "fsdp")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["resumed_equal"]
    assert result["groups"] == [2, 2]  # the head; the backbone's Linear, added at epoch 1
    torch.manual_seed(0)
    one = Plain()
    trainer = quiet_trainer(tmp_path / "one", max_epochs=4, callbacks=[torchrig.BackboneFinetuning(1, lambda e: 1.5)])
    trainer.fit(one, loader(32, batch_size=8, shuffle=True))
    for key, value in one.state_dict().items():
        torch.testing.assert_close(torch.tensor(result["weights"][key], dtype=value.dtype), value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_ddp_is_refused_with_the_reason(tmp_path: Path) -> None:
    done = run_two(tmp_path, "ddp")
    assert done.returncode != 0
    assert "BackboneFinetuning under DDP (2 processes): torch's DistributedDataParallel reduces only" in done.stderr
    assert "use strategy='fsdp' (the same weights as one process), or one process" in done.stderr
