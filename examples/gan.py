"""A GAN with two optimizers: manual optimization in the Trainer, and the same loop with the Rig.

    python examples/gan.py                            # the Trainer, one process
    python examples/gan.py --loop rig                 # the same training written with torchrig.Rig
    python examples/gan.py --devices 2                # 2 CPU processes (DDP; this one starts the other)
    python examples/gan.py --precision 16-mixed       # manual_backward scales the losses

The generator learns to turn noise into samples of a 2-D Gaussian; the discriminator learns to
tell them apart. Each batch steps the discriminator, then the generator: two backward passes and
two optimizers in one ``training_step``, which ``automatic_optimization = False`` hands to you.
The noise comes with the data, so both loops (and any number of processes) see the same numbers:
``--save PATH`` writes the final weights, and the two loops' weights agree.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce
from torch.utils.data import DataLoader, TensorDataset

import torchrig

LATENT = 4
CENTER = torch.tensor([2.0, -1.0])


def make_data(n: int = 512, seed: int = 0) -> TensorDataset:
    """Real samples from N(CENTER, 0.5^2) and, beside each, the noise the generator turns into a fake."""
    g = torch.Generator().manual_seed(seed)
    real = CENTER + 0.5 * torch.randn(n, 2, generator=g)
    noise = torch.randn(n, LATENT, generator=g)
    return TensorDataset(real, noise)


def discriminator_loss(d: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    real_logit, fake_logit = d(real), d(fake.detach())  # no gradient into the generator here
    return bce(real_logit, torch.ones_like(real_logit)) + bce(fake_logit, torch.zeros_like(fake_logit))


def generator_loss(d: nn.Module, fake: torch.Tensor) -> torch.Tensor:
    logit = d(fake)
    return bce(logit, torch.ones_like(logit))  # the generator wins when its fakes pass as real


class GAN(torchrig.TrainingModule):
    def __init__(self, lr: float = 2e-3, clip: float = 1.0) -> None:
        super().__init__()
        self.automatic_optimization = False  # training_step steps both optimizers itself
        self.lr, self.clip = lr, clip
        self.generator = nn.Sequential(nn.Linear(LATENT, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(noise)

        d_loss = discriminator_loss(self.discriminator, real, fake)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt_d.step()

        g_loss = generator_loss(self.discriminator, fake)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return optimizers_for(self)


def optimizers_for(gan: GAN) -> list[torch.optim.Optimizer]:
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=gan.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=gan.lr, betas=(0.5, 0.999))
    return [opt_g, opt_d]


def strategy_for(devices: int) -> Any:
    """DDP needs ``find_unused_parameters`` here: the discriminator's backward does not reach the generator."""
    return torchrig.DDPStrategy(find_unused_parameters=True) if devices > 1 else "auto"


def train_with_trainer(gan: GAN, *, devices: int, precision: str, epochs: int, seed: int) -> torchrig.Trainer:
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy_for(devices),
        precision=precision,
        max_epochs=epochs,
        seed=seed,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(gan, DataLoader(make_data(), batch_size=32, shuffle=True))
    return trainer


def train_with_rig(gan: GAN, *, devices: int, precision: str, epochs: int, seed: int) -> torchrig.Rig:
    """The same training as a hand-written loop: each network prepared on its own."""
    rig = torchrig.Rig(accelerator="cpu", devices=devices, precision=precision)
    rig.seed_everything(seed)
    opt_g, opt_d = optimizers_for(gan)
    loader = DataLoader(make_data(), batch_size=32, shuffle=True)
    g, d, opt_g, opt_d, loader = rig.prepare(gan.generator, gan.discriminator, opt_g, opt_d, loader)
    for _ in range(epochs):
        for real, noise in loader:
            fake = g(noise)
            d_loss = discriminator_loss(d, real, fake)
            opt_d.zero_grad()
            rig.backward(d_loss)
            rig.clip_gradients(d, opt_d, max_norm=gan.clip)
            opt_d.step()
            g_loss = generator_loss(d, fake)
            opt_g.zero_grad()
            rig.backward(g_loss)
            opt_g.step()
    return rig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", choices=("trainer", "rig"), default="trainer")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save", default=None, help="write the final weights here (torch.save)")
    args = parser.parse_args()
    torch.manual_seed(0)
    gan = GAN()
    kwargs = {"devices": args.devices, "precision": args.precision, "epochs": args.epochs, "seed": 1}
    if args.loop == "trainer":
        rank_zero = train_with_trainer(gan, **kwargs).is_global_zero
    else:
        rank_zero = train_with_rig(gan, **kwargs).is_global_zero
    if not rank_zero:
        return
    with torch.no_grad():
        fakes = gan.generator(make_data(256, seed=5).tensors[1])
    mean = ", ".join(f"{v:.2f}" for v in fakes.mean(0).tolist())
    print(f"{args.loop}: {args.devices} process(es), {args.precision}: generated mean ({mean}), real (2.00, -1.00)")
    if args.save:
        torch.save(gan.state_dict(), os.fspath(args.save))


if __name__ == "__main__":
    main()
