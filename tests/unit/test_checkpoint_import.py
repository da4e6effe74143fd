"""``torchrig checkpoint import``: checkpoints Lightning 2.x and Accelerate 1.x wrote (issue 21).

The files under ``tests/data/peers/`` were written by the libraries themselves
(``make_peer_checkpoints.py`` regenerates them); ``*_expected.safetensors`` hold the tensors the
peers' live objects had when they saved, so a resume is compared with them bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.cli import main

PEERS = Path(__file__).resolve().parents[1] / "data" / "peers"
LIGHTNING = PEERS / "lightning.ckpt"
ACCELERATE = PEERS / "accelerate"


def expected(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with safetensors.safe_open(str(PEERS / f"{name}_expected.safetensors"), "pt") as f:  # type: ignore[no-untyped-call]
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        return tensors, {k: json.loads(v) for k, v in f.metadata().items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.fixture(autouse=True)
def narrow_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")  # an error line is never wrapped (a path stays whole)


def run_import(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main(["checkpoint", "import", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


class Lit(nn.Module):
    """The LightningModule's layout: the network under the attribute ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 2)


def resume_into(path: Path, model: nn.Module) -> tuple[dict[str, Any], torch.optim.Optimizer, Any]:
    rig = torchrig.Rig(accelerator="cpu")
    model = rig.prepare(model)
    optimizer = rig.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    left = rig.load(path, {"module": model, "optimizer_0": optimizer, "scheduler_0": scheduler})
    return left, optimizer, scheduler


def assert_optimizer_as_saved(optimizer: torch.optim.Optimizer, want: dict[str, torch.Tensor], lr: float) -> None:
    state = optimizer.state_dict()["state"]
    names = {k for k in want if k.startswith("optimizer/")}
    assert names and {f"optimizer/{i}/{n}" for i, s in state.items() for n in s} == names
    for i, s in state.items():
        for n, value in s.items():
            assert same_bits(value, want[f"optimizer/{i}/{n}"]), (i, n)
    assert optimizer.param_groups[0]["lr"] == lr


@pytest.mark.timeout(60)
def test_lightning_checkpoint_resumes_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want, meta = expected("lightning")
    code, out, err = run_import(capsys, LIGHTNING, tmp_path / "imported")
    assert code == 0, err
    assert f"imported Lightning {meta['lightning']} checkpoint" in out
    assert "optimizer_0: torch.optim.adam.Adam (inferred" in out
    assert "scheduler_0: torch.optim.lr_scheduler.StepLR (inferred" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert any("callbacks" in w and "ModelCheckpoint" in w for w in warnings), out
    assert any("loop state is not carried over" in w for w in warnings), out
    assert any("no RNG state" in w and "seed 0" in w for w in warnings), out

    model = Lit()
    left, optimizer, scheduler = resume_into(tmp_path / "imported", model)
    for name, value in model.state_dict().items():
        assert same_bits(value, want[f"module/{name}"]), name
    assert_optimizer_as_saved(optimizer, want, meta["lr"])
    assert scheduler.get_last_lr() == [meta["lr"]]
    assert (left["step"], left["epoch"]) == (meta["global_step"], meta["epoch"])
    assert left["loop"]["epoch_finished"] and left["loop"]["global_step"] == meta["global_step"]
    # Lightning keeps no RNG: the run continues from that of seed 0, as if torch.manual_seed(0) ran.
    assert same_bits(torch.get_rng_state(), torch.Generator().manual_seed(0).get_state())


@pytest.mark.timeout(60)
def test_lightning_checkpoint_saved_inside_an_epoch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = torch.load(PEERS / "lightning_mid.ckpt", weights_only=True)  # what Lightning wrote, read directly
    code, out, err = run_import(capsys, PEERS / "lightning_mid.ckpt", tmp_path / "imported")
    assert code == 0, err
    model = Lit()
    left, optimizer, scheduler = resume_into(tmp_path / "imported", model)
    for name, value in model.state_dict().items():
        assert same_bits(value, saved["state_dict"][name]), name
    for i, state in optimizer.state_dict()["state"].items():
        assert state.keys() == saved["optimizer_states"][0]["state"][i].keys()
        for n, value in state.items():
            assert same_bits(value, saved["optimizer_states"][0]["state"][i][n]), (i, n)
    assert scheduler.state_dict() == saved["lr_schedulers"][0]
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]
    assert left["loop"] == {
        "epoch": saved["epoch"],
        "batch_idx": batches,
        "global_step": saved["global_step"],
        "epoch_finished": False,
        "val_pending": False,
    }
    assert left["train_loader"] == {"epoch": saved["epoch"], "batches_seen": batches}
    assert f"epoch {saved['epoch']} (counted from 0) stopped after {batches} batches" in out


@pytest.mark.timeout(90)
def test_lightning_checkpoint_saved_after_the_fit_records_the_epoch_it_trained_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning's ``trainer.save_checkpoint`` after a 2-epoch fit records ``epoch`` 2 (the next
    epoch). Imported, the loop continues with epoch 2 and the checkpoint records epoch 1, the epoch
    its last step trained in, as a Trainer's own end-of-fit save and its name ``epoch=1-...`` do."""
    import lightning as L

    class Module(L.LightningModule):  # Continued's, under Lightning
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(4, 2)

        training_step = Continued.training_step
        configure_optimizers = Continued.configure_optimizers

    data = DataLoader(peer_data(), batch_size=4)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), data)
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    assert torch.load(tmp_path / "after_fit.ckpt", weights_only=True)["epoch"] == 2  # what Lightning wrote
    code, out, err = run_import(capsys, tmp_path / "after_fit.ckpt", tmp_path / "imported")
    assert code == 0, err
    assert "  step 4, epoch 1" in out.splitlines()
    assert "a Trainer starts epoch 2 (counted from 0) at its first batch" in out
    assert torchrig.checkpoint.read_summary(tmp_path / "imported")["epoch"] == 1
    left = torchrig.checkpoint.read_values(tmp_path / "imported")
    assert left["epoch"] == 1
    assert main(["checkpoint", "inspect", "--json", str(tmp_path / "imported")]) == 0
    assert json.loads(capsys.readouterr().out)["epoch"] == 1


@pytest.mark.timeout(60)
def test_strip_and_add_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want, _ = expected("lightning")
    code, _, err = run_import(capsys, LIGHTNING, tmp_path / "plain", "--strip-prefix", "model.")
    assert code == 0, err
    linear = nn.Linear(4, 2)  # the network alone: Lightning's "model.weight" is its "weight"
    resume_into(tmp_path / "plain", linear)
    assert same_bits(linear.weight.detach(), want["module/model.weight"])

    code, _, err = run_import(
        capsys, LIGHTNING, tmp_path / "deeper", "--strip-prefix", "model.", "--add-prefix", "net."
    )
    assert code == 0, err
    assert sorted(torchrig.checkpoint.module_weights(tmp_path / "deeper")["module"]) == ["net.bias", "net.weight"]

    code, _, err = run_import(capsys, LIGHTNING, tmp_path / "typo", "--strip-prefix", "modle.")
    assert code == 2 and err.startswith("torchrig checkpoint import: --strip-prefix 'modle.': no key"), err
    assert "--strip-prefix 'modle.': no key starts with it; the keys of module are model.weight, model.bias" in err
    assert not (tmp_path / "typo").exists()


@pytest.mark.timeout(60)
def test_accelerate_directory_resumes_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want, meta = expected("accelerate")
    code, out, err = run_import(capsys, ACCELERATE, tmp_path / "imported")
    assert code == 0, err
    assert "imported Accelerate checkpoint" in out and "module: 2 tensors" in out
    assert "warning: Accelerate records no epoch" in out

    linear = nn.Linear(4, 2)
    left, optimizer, scheduler = resume_into(tmp_path / "imported", linear)
    for name, value in linear.state_dict().items():
        assert same_bits(value, want[f"module/{name}"]), name
    assert_optimizer_as_saved(optimizer, want, meta["lr"])
    assert scheduler.get_last_lr() == [meta["lr"]]
    assert left["step"] == meta["step"] and left["epoch"] == 0
    assert same_bits(torch.get_rng_state(), want["rng/torch"])  # random_states_0.pkl, restored


class Continued(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}


def peer_data() -> TensorDataset:  # the data make_peer_checkpoints.py trained on
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 2, generator=g))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("name", "first_epoch", "skip"),
    [
        ("lightning.ckpt", 2, 0),  # saved at the end of epoch 1 (counted from 0): epoch 2 is next
        ("lightning_mid.ckpt", 1, 1),  # saved after the 1st batch of epoch 1: its 2nd batch is next
    ],
)
def test_trainer_continues_the_lightning_run(
    name: str, first_epoch: int, skip: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_import(capsys, PEERS / name, tmp_path / "imported")
    assert code == 0, err
    trainer = torchrig.Trainer(
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    module = Continued()
    trainer.fit(module, DataLoader(peer_data(), batch_size=4), ckpt_path=tmp_path / "imported")

    # The rest of the run by hand, from the state Lightning saved (read straight from its file).
    saved = torch.load(PEERS / name, weights_only=True)
    net = nn.Linear(4, 2)
    net.load_state_dict({k.removeprefix("model."): v for k, v in saved["state_dict"].items()})
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    optimizer.load_state_dict(saved["optimizer_states"][0])
    scheduler.load_state_dict(saved["lr_schedulers"][0])
    steps = 0
    for epoch in range(first_epoch, trainer.max_epochs):
        for i, (x, y) in enumerate(DataLoader(peer_data(), batch_size=4)):
            if epoch == first_epoch and i < skip:
                continue
            nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        scheduler.step()

    assert trainer.global_step == saved["global_step"] + steps
    assert same_bits(module.model.weight.detach(), net.weight.detach())
    assert same_bits(module.model.bias.detach(), net.bias.detach())
    assert trainer.optimizers[0].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    if skip:
        assert "warning: Lightning saved inside epoch 1: its sampler's order is not in the checkpoint" in out


@pytest.mark.timeout(60)
def test_scaler_state_is_named_as_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = torch.load(LIGHTNING, weights_only=True)
    ck["MixedPrecision"] = {"scale": torch.tensor(1024.0), "_growth_tracker": 3}
    ck["extra_things"] = [1, 2]
    torch.save(ck, tmp_path / "amp.ckpt")
    code, out, err = run_import(capsys, tmp_path / "amp.ckpt", tmp_path / "imported")
    assert code == 0, err
    assert "warning: the AMP gradient scaler state (MixedPrecision) is not carried over" in out
    assert "warning: not carried over: extra_things (no torchrig counterpart)" in out


@pytest.mark.timeout(60)
def test_optimizer_and_scheduler_classes_can_be_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_import(capsys, ACCELERATE, tmp_path / "w", "--optimizer", "torch.optim.AdamW")
    assert code == 0, err
    assert "optimizer_0: torch.optim.adamw.AdamW (as --optimizer names it)" in out
    with pytest.raises(torchrig.checkpoint.CheckpointError, match=r"saved from a torch\.optim\.adamw\.AdamW"):
        resume_into(tmp_path / "w", nn.Linear(4, 2))  # the class is checked on load: Adam is refused

    code, out, err = run_import(capsys, ACCELERATE, tmp_path / "x", "--scheduler", "torch.nn.Linear")
    assert code == 2 and "Traceback" not in err
    assert "--scheduler 'torch.nn.Linear' is not a torch.optim.lr_scheduler.LRScheduler class" in err
    code, out, err = run_import(
        capsys, ACCELERATE, tmp_path / "x", "--optimizer", "torch.optim.Adam", "--optimizer", "torch.optim.SGD"
    )
    assert code == 2 and "2 --optimizer and 0 --scheduler classes given, but the checkpoint holds 1 optimizers" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.timeout(60)
def test_classes_hparams_and_keys_outside_the_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = torch.load(LIGHTNING, weights_only=True)
    ck["state_dict"]["criterion.pos_weight"] = torch.ones(2)
    ck["optimizer_states"][0]["param_groups"][0]["decoupled_weight_decay"] = True  # what AdamW saves
    ck["hyper_parameters"] = {"hidden": 8, "lr": 0.1}
    torch.save(ck, tmp_path / "adamw.ckpt")
    code, out, err = run_import(capsys, tmp_path / "adamw.ckpt", tmp_path / "imported", "--strip-prefix", "model.")
    assert code == 0, err
    assert "optimizer_0: torch.optim.adamw.AdamW (inferred" in out
    assert "warning: --strip-prefix 'model.' leaves out 1 keys of module outside it: criterion.pos_weight" in out
    assert sorted(torchrig.checkpoint.module_weights(tmp_path / "imported")["module"]) == ["bias", "weight"]
    assert torchrig.checkpoint.read_values(tmp_path / "imported")["hparams"] == {"hidden": 8, "lr": 0.1}

    fields = dict(ck["lr_schedulers"][0])
    del fields["step_size"], fields["gamma"]
    ck["lr_schedulers"][0] = {**fields, "lr_lambdas": [None]}  # a LambdaLR's state: no class has these fields
    torch.save(ck, tmp_path / "lambda.ckpt")
    code, _, err = run_import(capsys, tmp_path / "lambda.ckpt", tmp_path / "other")
    assert code == 2
    assert "cannot tell the class of scheduler 0 from its fields (lr_lambdas)" in err
    assert "name it with --scheduler, e.g. --scheduler torch.optim.lr_scheduler.StepLR" in err
    code, out, err = run_import(
        capsys, tmp_path / "lambda.ckpt", tmp_path / "other", "--scheduler", "torch.optim.lr_scheduler.LambdaLR"
    )
    assert code == 0, err
    assert "scheduler_0: torch.optim.lr_scheduler.LambdaLR (as --scheduler names it)" in out


@pytest.mark.timeout(60)
def test_accelerate_files_without_a_counterpart_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "acc"
    shutil.copytree(ACCELERATE, folder)
    for name in ("sampler.bin", "scaler.pt", "custom_checkpoint_0.pkl", "notes.txt"):
        (folder / name).write_bytes(b"never read")
    (folder / "pytorch_model_fsdp_0").mkdir()
    code, out, err = run_import(capsys, folder, tmp_path / "imported")
    assert code == 0, err
    for text in (
        "warning: not carried over: sampler.bin (the dataloader's position",
        "warning: the AMP gradient scaler state (scaler.pt) is not carried over",
        "warning: not carried over: custom_checkpoint_0.pkl (an object registered with",
        "warning: not carried over: notes.txt (not a file save_state writes)",
        "warning: not carried over: pytorch_model_fsdp_0 (a directory (FSDP or DeepSpeed shards are not imported))",
    ):
        assert text in out, text


class Touch:
    """Unpickling this would create ``path`` (``open(path, "w")``): the import must never run it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


@pytest.mark.timeout(60)
def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran"
    ck = torch.load(LIGHTNING, weights_only=True)
    ck["hyper_parameters"] = {"evil": Touch(marker)}
    torch.save(ck, tmp_path / "evil.ckpt")
    code, _, err = run_import(capsys, tmp_path / "evil.ckpt", tmp_path / "out")
    assert code == 2 and "Traceback" not in err
    assert f"({open.__module__}.open)" in err and "nothing in the file was run" in err
    assert not marker.exists() and not (tmp_path / "out").exists()

    # Accelerate's RNG file may name numpy's array classes, and nothing else.
    folder = tmp_path / "acc"
    shutil.copytree(ACCELERATE, folder)
    torch.save({"random_state": Touch(marker)}, folder / "random_states_0.pkl")
    code, _, err = run_import(capsys, folder, tmp_path / "out")
    assert code == 2 and f"({open.__module__}.open)" in err and "random_states_0.pkl" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_what_is_not_a_checkpoint_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    cases = [
        (text, "out", f"{text} is not a Lightning checkpoint: it is not a torch.save file"),
        (
            tmp_path / "plain.pt",
            "out",
            "is not a Lightning checkpoint: it has no 'state_dict' dict (it holds ['weights'])",
        ),
        (tmp_path / "missing", "out", "missing does not exist: give a Lightning .ckpt file or the directory"),
        (tmp_path / "empty", "out", "is not a directory Accelerate's save_state wrote: it has no model.safetensors"),
        (LIGHTNING, "taken", "taken: it is a directory that is not a torchrig checkpoint (it has no valid meta.json)"),
    ]
    for source, out, message in cases:
        code, _, err = run_import(capsys, source, tmp_path / out)
        assert code == 2, source
        assert message in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_a_seed_numpy_cannot_take_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrig.checkpoint.peers import import_checkpoint

    with pytest.raises(TypeError, match=r"seed=True must be an int, not bool \(NumPy's seeds\)"):
        import_checkpoint(LIGHTNING, tmp_path / "out", seed=True)  # type: ignore[arg-type]
    code, _, err = run_import(capsys, LIGHTNING, tmp_path / "out", "--seed", "-1")
    assert code == 2 and "seed=-1 must be an int in [0, 4294967295] (NumPy's seeds)" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_importing_again_replaces_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_import(capsys, ACCELERATE, tmp_path / "ck")[0] == 0
    (tmp_path / "link.ckpt").symlink_to(LIGHTNING)  # a link given as PATH is followed
    assert run_import(capsys, tmp_path / "link.ckpt", tmp_path / "ck")[0] == 0
    assert sorted(torchrig.checkpoint.module_weights(tmp_path / "ck")["module"]) == ["model.bias", "model.weight"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp directory left
