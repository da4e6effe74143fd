"""torchrig.tune.scale_batch_size, BatchSizeFinder and LearningRateFinder: what they find (against
Lightning's own Tuner and callbacks), that the fit afterwards equals one given the value
directly, their resume, and their errors."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from trainer_helpers import checkpointed_fit, lightning_trainer, params, quiet_trainer, regression_data, run_script

import torchrig
from torchrig.tune import scale_batch_size

LIMIT = 20  # the largest batch that "fits in memory"
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"  # the text Lightning's is_oom_error looks for


class SizedSteps:
    """A regression whose training_step runs out of memory (torch.OutOfMemoryError) above LIMIT
    samples; its loader is built with ``self.batch_size``. Records the batch sizes it trained.
    For torchrig's module and Lightning's alike."""

    batch_size: int
    net: torch.nn.Module
    tried: list[int]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if not self.tried or self.tried[-1] != len(x):
            self.tried.append(len(x))
        if len(x) > LIMIT:
            raise torch.OutOfMemoryError(OOM)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(regression_data(64), batch_size=self.batch_size, shuffle=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.training_step(batch, batch_idx)  # the same limit, without gradients
        self.log("test_loss", loss, batch_size=len(batch[0]))  # type: ignore[attr-defined]

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(regression_data(64), batch_size=self.batch_size)


class Sized(SizedSteps, torchrig.TrainingModule):
    def __init__(self, batch_size: int = 4, lr: float = 0.05, onecycle: bool = False) -> None:
        super().__init__()
        self.batch_size, self.lr, self.onecycle = batch_size, lr, onecycle
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.tried = []

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.onecycle:
            return opt
        total = self.trainer.estimated_stepping_batches  # depends on the batch size
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=total)}


def lightning_sizes(tmp_path: Path, mode: str, margin: float) -> tuple[int, list[int]]:
    """Lightning's own Tuner on the same model: the size it finds and the sizes it tried."""
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    class LSized(SizedSteps, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # Lightning's first trial runs with the loader built before the search: start at init_val
            self.batch_size = 2
            self.net = torch.nn.Linear(4, 1)
            self.tried = []

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = lightning_trainer(tmp_path, max_epochs=1)
    model = LSized()
    found = Tuner(trainer).scale_batch_size(model, mode=mode, margin=margin)
    assert found is not None
    return found, model.tried


@pytest.mark.parametrize(
    ("mode", "margin", "expected"), [("power", 0.05, 16), ("binsearch", 0.0, 20), ("binsearch", 0.05, 19)]
)
def test_scale_batch_size_finds_what_lightnings_tuner_finds(
    tmp_path: Path, mode: str, margin: float, expected: int
) -> None:
    module = Sized()
    found = scale_batch_size(quiet_trainer(tmp_path), module, mode=mode, margin=margin)
    assert found == module.batch_size == expected
    theirs, tried = lightning_sizes(tmp_path, mode, margin)
    assert theirs == expected
    assert module.tried == tried  # the same trials, in the same order
    assert module.tried[:5] == [2, 4, 8, 16, 32]


def test_scale_batch_size_sets_a_datamodule_or_hparams_attribute(tmp_path: Path) -> None:
    class Data(torchrig.DataModule):
        def __init__(self) -> None:
            self.batch_size = 3

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(regression_data(64), batch_size=self.batch_size)

    class NoSize(Sized):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

    data = Data()
    assert scale_batch_size(quiet_trainer(tmp_path), NoSize(), datamodule=data, max_trials=3) == data.batch_size == 8

    class InHparams(NoSize):
        def __init__(self, batch_size: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(regression_data(64), batch_size=self.hparams.batch_size)

    module = InHparams()
    assert scale_batch_size(quiet_trainer(tmp_path), module, max_val=12) == module.hparams.batch_size == 12


def test_scale_batch_size_puts_back_weights_optimizer_and_rng(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Sized()
    before = params(module)
    rng = torch.get_rng_state()
    scale_batch_size(quiet_trainer(tmp_path), module)
    assert all(torch.equal(a, b) for a, b in zip(before, params(module), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in module.parameters())


def test_scale_batch_size_refuses_what_it_cannot_search(tmp_path: Path) -> None:
    class NoSize(Sized):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

    msg = "scale_batch_size(): batch_arg_name='batch_size' is not an attribute of NoSize, its hparams nor a datamodule"
    with pytest.raises(ValueError, match=re.escape(msg)):
        scale_batch_size(quiet_trainer(tmp_path), NoSize())
    with pytest.raises(ValueError, match=re.escape("mode='linear'; use one of 'power', 'binsearch'")):
        scale_batch_size(quiet_trainer(tmp_path), Sized(), mode="linear")
    with pytest.raises(ValueError, match=re.escape("margin=1.5 must be a number in [0, 1)")):
        torchrig.BatchSizeFinder(margin=1.5)

    class Huge(Sized):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise torch.OutOfMemoryError(OOM)

    with pytest.raises(RuntimeError, match=re.escape("every batch size tried ran out of memory, down to 1")):
        scale_batch_size(quiet_trainer(tmp_path), Huge())

    class Broken(Sized):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):  # not memory: raised as it is
        scale_batch_size(quiet_trainer(tmp_path), Broken())


def fit_with(tmp_path: Path, callbacks: list[Any], module: Sized, **kwargs: Any) -> torchrig.Trainer:
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=callbacks, seed=7, **kwargs)
    trainer.fit(module)
    return trainer


def test_batch_size_finder_fit_equals_a_fit_given_the_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    searched = Sized(onecycle=True)
    finder = torchrig.BatchSizeFinder(mode="binsearch", margin=0.0)
    fit_with(tmp_path / "a", [finder], searched)
    assert finder.optimal_batch_size == searched.batch_size == 20
    torch.manual_seed(0)
    direct = Sized(batch_size=20, onecycle=True)
    fit_with(tmp_path / "b", [], direct)
    assert searched.tried[-1] == direct.tried[-1] == 64 - 3 * 20  # each epoch's last, smaller batch
    for a, b in zip(params(searched), params(direct), strict=True):
        assert torch.equal(a, b)


def test_scale_batch_size_then_fit_equals_a_fit_given_the_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    searched = Sized()
    trainer = quiet_trainer(tmp_path, max_epochs=2)
    scale_batch_size(trainer, searched)
    trainer.fit(searched)
    torch.manual_seed(0)
    direct = Sized(batch_size=16)
    quiet_trainer(tmp_path, max_epochs=2).fit(direct)
    for a, b in zip(params(searched), params(direct), strict=True):
        assert torch.equal(a, b)


def test_batch_size_finder_resumes_with_the_size_it_found(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt: Any = None, root: Path = tmp_path) -> tuple[Sized, torchrig.BatchSizeFinder]:
        torch.manual_seed(0)
        # Built with 3: the resumed fit's first loader cannot hold the saved position (40 samples)
        # in its batches; the position goes to the loader of 20 as saved.
        module = Sized(batch_size=3)  # no OneCycle: max_steps=2 would size its schedule
        finder = torchrig.BatchSizeFinder(mode="binsearch", margin=0.0)
        checkpointed_fit(root, module, [finder], max_steps=max_steps, ckpt=ckpt, max_epochs=2)
        return module, finder

    whole, _ = fit(-1, root=tmp_path / "a")
    fit(2, root=tmp_path / "b")  # two steps of 20 into the first epoch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loader of 3 never runs: no "samples will be seen again"
        resumed, finder = fit(-1, ckpt="last", root=tmp_path / "b")
    assert finder.optimal_batch_size == resumed.batch_size == 20
    assert resumed.tried == [20, 4, 20, 4]  # no search: the rest of epoch 0 (20, then 4), epoch 1
    for a, b in zip(params(whole), params(resumed), strict=True):
        assert torch.equal(a, b)


def test_batch_size_finder_refuses_a_loader_given_to_fit(tmp_path: Path) -> None:
    module = Sized()
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.BatchSizeFinder()])
    msg = "BatchSizeFinder asks train_dataloader() for loaders of each batch size it tries, but this fit was given"
    with pytest.raises(ValueError, match=re.escape(msg)):
        trainer.fit(module, module.train_dataloader())


class WithLR(Sized):
    """Sized at batch 8, whose configure_optimizers reads ``self.lr`` (as Lightning's examples do)."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__(batch_size=8, lr=lr)


def test_learning_rate_finder_sweeps_as_lr_find_and_fits_as_given_directly(tmp_path: Path) -> None:
    finder = torchrig.LearningRateFinder(num_training_steps=30, max_lr=0.5)
    torch.manual_seed(0)
    searched = WithLR()
    fit_with(tmp_path / "a", [finder], searched)
    assert finder.optimal_lr is not None and len(finder.optimal_lr.lrs) == 30
    suggested = finder.optimal_lr.suggestion()
    assert finder.suggested_lr == searched.lr == suggested != 1e-3
    # The same sweep as torchrig.tune.lr_find on the same module, data and seed: one implementation.
    torch.manual_seed(0)
    module = WithLR()
    alone = torchrig.tune.lr_find(
        quiet_trainer(tmp_path, seed=7), module, module.train_dataloader(), max_lr=0.5, num_training=30
    )
    assert alone.lrs == finder.optimal_lr.lrs and alone.losses == finder.optimal_lr.losses
    torch.manual_seed(0)
    direct = WithLR(lr=suggested)
    fit_with(tmp_path / "b", [], direct)
    for a, b in zip(params(searched), params(direct), strict=True):
        assert torch.equal(a, b)


def test_learning_rate_finder_resumes_with_its_learning_rate(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt: Any = None, root: Path = tmp_path) -> tuple[WithLR, torchrig.LearningRateFinder]:
        torch.manual_seed(0)
        module, finder = WithLR(), torchrig.LearningRateFinder(num_training_steps=30, max_lr=0.5)
        checkpointed_fit(root, module, [finder], max_steps=max_steps, ckpt=ckpt, max_epochs=2)
        return module, finder

    whole, first = fit(-1, root=tmp_path / "a")
    fit(3, root=tmp_path / "b")
    resumed, finder = fit(-1, ckpt="last", root=tmp_path / "b")
    assert finder.optimal_lr is None  # no second sweep
    assert finder.suggested_lr == resumed.lr == first.suggested_lr
    for a, b in zip(params(whole), params(resumed), strict=True):
        assert torch.equal(a, b)


def test_learning_rate_finder_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    msg = "LearningRateFinder(mode='linear'): torchrig's sweep grows the learning rate exponentially only"
    with pytest.raises(ValueError, match=re.escape(msg)):
        torchrig.LearningRateFinder(mode="linear")
    with pytest.raises(ValueError, match=re.escape("min_lr=0 must be a finite number > 0")):
        torchrig.LearningRateFinder(min_lr=0)

    class NoLR(WithLR):
        def __init__(self) -> None:
            super().__init__()
            del self.lr

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[torchrig.LearningRateFinder(num_training_steps=20)])
    msg = (
        "LearningRateFinder: attr_name='lr or learning_rate' is not an attribute of NoLR, its hparams nor a datamodule"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        trainer.fit(NoLR())


def test_scale_batch_size_under_a_real_memory_limit(tmp_path: Path) -> None:
    """A process whose address space is capped (RLIMIT_AS): the CPU allocator's own error ends
    the growth, and the search keeps the largest size that ran."""
    run_script(
        tmp_path,
        """
import resource, sys, torch, torchrig
from torch.utils.data import DataLoader, TensorDataset
from trainer_helpers import quiet_trainer

MB = 1 << 20

class Hungry(torchrig.TrainingModule):
    def __init__(self):
        super().__init__()
        self.batch_size, self.layer = 2, torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        hungry = torch.ones(len(x), 16 * MB // 4)  # 16 MiB a sample: like activations
        return torch.nn.functional.mse_loss(self.layer(x), y) + 0 * hungry.sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

trainer = quiet_trainer(sys.argv[1])
with open("/proc/self/status") as f:
    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (used + 400 * MB, resource.RLIM_INFINITY))  # room for ~20 samples
found = torchrig.tune.scale_batch_size(trainer, Hungry())
print("found", found)
assert found in (8, 16), found
""",
        str(tmp_path),
    )


@pytest.mark.parametrize("finder", ["BatchSizeFinder", "LearningRateFinder"])
def test_finders_skip_a_fast_dev_run(tmp_path: Path, finder: str) -> None:
    module = WithLR()
    trainer = quiet_trainer(tmp_path, fast_dev_run=True, callbacks=[getattr(torchrig, finder)()])
    with pytest.warns(UserWarning, match=re.escape(f"{finder}: skipped under fast_dev_run")):
        trainer.fit(module)
    assert module.tried == [8] and module.batch_size == 8 and module.lr == 1e-3  # one batch, as given


def test_batch_size_finder_searches_at_the_start_of_test_as_lightnings(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder as LightningBatchSizeFinder

    torch.manual_seed(0)
    module, finder = Sized(), torchrig.BatchSizeFinder()
    ours = quiet_trainer(tmp_path, callbacks=[finder]).test(module)
    assert finder.optimal_batch_size == module.batch_size == 16
    assert module.tried[-1] == 16  # the test itself ran with the size found
    direct = quiet_trainer(tmp_path).test(module)  # the same module, given 16
    assert ours == direct

    class LSized(SizedSteps, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.tried = 2, []
            self.net = torch.nn.Linear(4, 1)

    theirs_finder = LightningBatchSizeFinder()
    theirs = LSized()
    lightning_trainer(tmp_path, callbacks=[theirs_finder]).test(theirs, verbose=False)
    assert theirs_finder.optimal_batch_size == theirs.batch_size == 16
    assert module.tried[:5] == theirs.tried[:5] == [2, 4, 8, 16, 32]


def test_batch_size_finder_refuses_a_loader_given_to_test(tmp_path: Path) -> None:
    module = Sized()
    trainer = quiet_trainer(tmp_path, callbacks=[torchrig.BatchSizeFinder()])
    msg = "BatchSizeFinder asks the test loader method for loaders of each batch size it tries, but this run was given"
    with pytest.raises(ValueError, match=re.escape(msg)):
        trainer.test(module, module.test_dataloader())
