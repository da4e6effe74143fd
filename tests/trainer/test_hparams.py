"""save_hyperparameters(), module.hparams, hparams in checkpoints and loggers, load_from_checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from trainer_helpers import loader, quiet_trainer

import torchrig
from torchrig.checkpoint import CheckpointError, read_values
from torchrig.checkpoint.files import META, sha256_file


class Net(torchrig.TrainingModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05, acts: tuple[str, ...] = ("tanh",), opt: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Child(Net):
    """save_hyperparameters() in the base class's __init__ records the subclass's arguments."""

    def __init__(self, width: int = 6, **kwargs: Any) -> None:
        super().__init__(hidden=width, **kwargs)


class WithBackbone(torchrig.TrainingModule):
    def __init__(self, backbone: torch.nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone


def fit(module: torchrig.TrainingModule, tmp_path: Path, **kwargs: Any) -> Path:
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, enable_model_summary=False, **kwargs)
    trainer.fit(module, loader(16))
    return tmp_path / "checkpoints" / "last" if not kwargs.get("logger") else trainer.log_dir / "checkpoints" / "last"


def test_save_hyperparameters_records_the_init_arguments() -> None:
    module = Net(hidden=5, opt={"name": "sgd", "betas": [0.9, 0.99]})
    assert module.hparams == {"hidden": 5, "lr": 0.05, "acts": ("tanh",), "opt": {"name": "sgd", "betas": [0.9, 0.99]}}
    assert module.hparams.lr == 0.05  # keys read as attributes
    assert Child(width=3, lr=0.1).hparams == {"width": 3, "lr": 0.1}  # the outermost __init__'s
    assert WithBackbone(torch.nn.Linear(2, 2), scale=2.0).hparams == {"scale": 2.0}
    assert torchrig.TrainingModule().hparams == {}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (torch.nn.Linear(1, 1), "'opt' is a torch.nn.modules.linear.Linear"),
        (torch.ones(2), "'opt' is a torch.Tensor"),
        ([1, Path("x")], r"'opt'\[1\] is a pathlib.PosixPath"),
        ({1: "a"}, r"'opt' has the key 1 \(int\)"),
        ({"f": print}, r"'opt'\['f'\] is a builtins.builtin_function_or_method"),
    ],
)
def test_a_non_plain_argument_is_refused_when_recorded(value: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"Net.__init__ argument {shown}"):
        Net(opt=value)
    with pytest.raises(ValueError, match=r"save_hyperparameters\(ignore=\['opt'\]\) leaves it out"):
        Net(opt=value)


def test_save_hyperparameters_outside_init_and_bad_ignore() -> None:
    module = Net()
    with pytest.raises(RuntimeError, match=r"Net.save_hyperparameters\(\) records the arguments of __init__"):
        module.save_hyperparameters()

    class Typo(torchrig.TrainingModule):
        def __init__(self, a: int = 1) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["b"])

    with pytest.raises(ValueError, match=r"ignore=\['b'\]\): Typo.__init__ has no such argument"):
        Typo()


def test_hparams_set_by_hand_are_checked_too() -> None:
    module = Net()
    module.hparams = {"lr": 0.1}
    assert module.hparams == {"lr": 0.1} and module.hparams.lr == 0.1
    with pytest.raises(ValueError, match=r"hparams\['path'\] is a pathlib.PosixPath, not plain data"):
        module.hparams = {"path": Path("x")}
    with pytest.raises(TypeError, match="hparams must be a dict of plain values, got list"):
        module.hparams = [1]  # type: ignore[assignment]


def test_round_trip_through_a_checkpoint_with_overrides(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Net(hidden=5, lr=0.1, opt={"name": "sgd"})
    last = fit(module, tmp_path, logger=True)
    assert read_values(last)["hparams"] == {"hidden": 5, "lr": 0.1, "acts": ("tanh",), "opt": {"name": "sgd"}}
    saved = yaml.safe_load((last.parent.parent / "hparams.yaml").read_text())  # the logger got them too
    assert saved == {"hidden": 5, "lr": 0.1, "acts": ["tanh"], "opt": {"name": "sgd"}}

    loaded = Net.load_from_checkpoint(last)
    assert loaded.hparams == module.hparams
    assert all(
        torch.equal(a, b) for a, b in zip(module.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
    changed = Net.load_from_checkpoint(last, lr=0.5)
    assert changed.hparams.lr == 0.5 and changed.hparams.hidden == 5
    assert torch.equal(changed.net[0].weight, module.net[0].weight)

    with pytest.raises(CheckpointError, match=r"Net.__init__ takes no argument 'depth' \(from the overrides of"):
        Net.load_from_checkpoint(last, depth=3)
    with pytest.raises(CheckpointError, match=r"the weights in .* do not fit Net\(hidden=7"):
        Net.load_from_checkpoint(last, hidden=7)


def test_an_ignored_argument_is_given_at_load(tmp_path: Path) -> None:
    class Backbone(WithBackbone):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.backbone(x) * self.hparams.scale, y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = Backbone(torch.nn.Linear(4, 1), scale=2.0)
    last = fit(module, tmp_path)
    loaded = Backbone.load_from_checkpoint(last, backbone=torch.nn.Linear(4, 1))
    assert loaded.hparams == {"scale": 2.0}
    assert torch.equal(loaded.backbone.weight, module.backbone.weight)


def _rewrite_state(last: Path, change: Any) -> None:
    """Change the checkpoint's state.pt values and list its new hash in meta.json (a forged file)."""
    folder = last.resolve()
    state = folder / "state.pt"
    blob = torch.load(state, weights_only=True)  # this test's own checkpoint
    change(blob["values"])
    torch.save(blob, state)
    meta = json.loads((folder / META).read_text())
    meta["files"]["state.pt"].update(size=state.stat().st_size, sha256=sha256_file(state, state.stat().st_size))
    (folder / META).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v.update(hparams=[1, 2]), r"holds hparams as a list, not a dict"),
        (lambda v: v.update(hparams={"hidden": torch.ones(1)}), r"hparams\['hidden'\] is a torch.Tensor, not plain"),
        (lambda v: v.update(hparams={"hidden": 5, "rm_rf": "/"}), r"Net.__init__ takes no argument 'rm_rf' \(from the "
         r"checkpoint's hparams"),
    ],
)  # fmt: skip
def test_a_malformed_hparams_entry_is_refused(tmp_path: Path, change: Any, message: str) -> None:
    last = fit(Net(hidden=5), tmp_path)
    _rewrite_state(last, change)
    with pytest.raises(CheckpointError, match=message):
        Net.load_from_checkpoint(last)


def test_a_pickle_payload_in_hparams_runs_no_code(tmp_path: Path) -> None:
    last = fit(Net(hidden=5), tmp_path)
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return (Path.touch, (ran,))

    _rewrite_state(last, lambda values: values.update(hparams={"hidden": Payload()}))
    with pytest.raises(CheckpointError, match=r"state.pt.*(Payload|pathlib)") as refused:
        Net.load_from_checkpoint(last)
    assert not ran.exists(), refused.value


def test_a_tampered_checkpoint_is_refused_by_its_checksum(tmp_path: Path) -> None:
    last = fit(Net(hidden=5), tmp_path)
    state = last.resolve() / "state.pt"
    data = bytearray(state.read_bytes())
    data[-10] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*state.pt"):
        Net.load_from_checkpoint(last)


def test_a_checkpoint_without_hparams_builds_with_the_defaults(tmp_path: Path) -> None:
    class Plain(Net):
        def __init__(self) -> None:
            torchrig.TrainingModule.__init__(self)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = Plain()
    last = fit(module, tmp_path)
    assert "hparams" not in read_values(last)
    assert torch.equal(Plain.load_from_checkpoint(last).net[0].weight, module.net[0].weight)
