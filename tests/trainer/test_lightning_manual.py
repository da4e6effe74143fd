"""A two-optimizer GAN under manual optimization (toggle_optimizer, toggled_optimizer,
manual_backward, clip_gradients, its schedulers stepped at ``trainer.is_last_batch``) under
Lightning 2.6's Trainer and under torchrig's: the same losses, weights and logged values."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hook_recording import quiet_lightning
from torch.utils.data import DataLoader, TensorDataset

import torchrig

pl = pytest.importorskip("lightning.pytorch")


def gan_class(base: type, seen: list[Any]) -> type:
    class GAN(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.generator, self.discriminator = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_g, opt_d = self.optimizers()
            x = batch[0]
            self.toggle_optimizer(opt_d)
            fake = self.generator(x).detach()
            d_loss = torch.nn.functional.softplus(-self.discriminator(x)).mean()
            d_loss = d_loss + torch.nn.functional.softplus(self.discriminator(fake)).mean()
            self.manual_backward(d_loss)
            self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            with self.toggled_optimizer(opt_g):
                frozen = [p.requires_grad for p in self.discriminator.parameters()]
                g_loss = torch.nn.functional.softplus(-self.discriminator(self.generator(x))).mean()
                self.manual_backward(g_loss)
                opt_g.step()
                opt_g.zero_grad()
            if self.trainer.is_last_batch:
                for scheduler in self.lr_schedulers():
                    scheduler.step()
            self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)
            grads = [p.grad is None for p in self.discriminator.parameters()]
            seen.append((batch_idx, frozen, grads, [p.requires_grad for p in self.parameters()]))

        def configure_optimizers(self) -> Any:
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=0.02)
            halve = torch.optim.lr_scheduler.StepLR
            return [opt_g, opt_d], [halve(opt_g, 1, 0.5), halve(opt_d, 1, 0.5)]

    return GAN


def fit(framework: str, tmp_path: Any, **settings: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    seen: list[Any] = []
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(18, 3, generator=g)), batch_size=4)
    common = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    common |= {"enable_model_summary": False, "default_root_dir": tmp_path / framework, **settings}
    if framework == "lightning":
        quiet_lightning()
        module = gan_class(pl.LightningModule, seen)()
        trainer: Any = pl.Trainer(accelerator="cpu", **common)
    else:
        module = gan_class(torchrig.TrainingModule, seen)()
        trainer = torchrig.Trainer(accelerator="cpu", devices=1, **common)
    trainer.fit(module, data)
    metrics = {k: round(float(v), 5) for k, v in trainer.callback_metrics.items()}
    lrs = [o.param_groups[0]["lr"] for o in trainer.optimizers]
    return {"seen": seen, "metrics": metrics, "lrs": lrs, "weights": module.state_dict(), "step": trainer.global_step}


@pytest.mark.timeout(60)
def test_a_gan_with_toggled_optimizers_trains_as_under_lightning(tmp_path: Any) -> None:
    theirs = fit("lightning", tmp_path, max_epochs=2)
    ours = fit("torchrig", tmp_path, max_epochs=2)
    assert len(ours["seen"]) == 10 and ours["seen"] == theirs["seen"]
    # inside toggled_optimizer(opt_g) the discriminator was frozen; after it, everything trains again
    assert ours["seen"][0][1] == [False, False] and all(ours["seen"][-1][3])
    assert ours["metrics"] == theirs["metrics"] and set(ours["metrics"]) == {"d_loss", "g_loss"}
    assert ours["lrs"] == theirs["lrs"] == [0.01 * 0.25, 0.02 * 0.25]  # stepped at each epoch's last batch
    for key, value in theirs["weights"].items():
        assert torch.allclose(ours["weights"][key], value, atol=1e-6), key
    # The one difference (docs/migrating.md): Lightning counts each optimizer.step() in
    # global_step, torchrig each batch.
    assert (ours["step"], theirs["step"]) == (10, 20)
