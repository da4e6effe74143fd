"""An accelerator that carries its precision and strategy (the Accelerator documents' composition).

``CPUAccelerator(precision_plugin=..., training_type_plugin=...)`` handed to ``Rig``/``Trainer`` as
one object: they use what it carries when their own argument is not given, and two different
values are an error that names both.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrig
from torchrig import (
    ACCELERATOR_REGISTRY,
    Accelerator,
    CPUAccelerator,
    DDPStrategy,
    FP8Mixed,
    Precision,
    Rig,
    SingleDeviceStrategy,
    TorchDeviceAccelerator,
    Trainer,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # dist_helpers


class _CPUBacked(Accelerator):
    """A user's accelerator that inherits ``Accelerator.__init__`` (so it composes)."""

    device_type = "cpu"

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return CPUAccelerator.parse_devices(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cpu")] * devices

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True


class _WithOwnInit(_CPUBacked):
    """A user's accelerator with its own argument that passes the carried ones on."""

    def __init__(self, *, chip: str, **carried: Any) -> None:
        super().__init__(**carried)
        self.chip = chip


class _NoSuperInit(_CPUBacked):
    """A user's accelerator whose ``__init__`` never calls ``super().__init__``: it carries nothing."""

    def __init__(self, chip: str) -> None:
        self.chip = chip


def _quiet_trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    return Trainer(
        default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs
    )


# -- what an accelerator carries ------------------------------------------------------------
def test_a_builtin_accelerator_carries_names_in_canonical_form() -> None:
    acc = CPUAccelerator(precision="bf16", strategy=" Single ")
    assert acc.precision == "bf16-mixed" and acc.strategy == "single"
    assert acc.precision_plugin == "bf16-mixed" and acc.training_type_plugin == "single"
    assert repr(acc) == "CPUAccelerator(precision='bf16-mixed', strategy='single')"
    assert acc.name() == "cpu"
    assert repr(CPUAccelerator()) == "CPUAccelerator()" and CPUAccelerator().precision is None


def test_the_documents_names_are_aliases() -> None:
    strategy = DDPStrategy()
    acc = CPUAccelerator(precision_plugin="16-true", training_type_plugin=strategy)
    assert acc.precision == "16-true" and acc.strategy is strategy


def test_the_generic_and_registry_built_accelerators_carry_too() -> None:
    acc = TorchDeviceAccelerator(device_type="cuda", precision="bf16-mixed", training_type_plugin="ddp")
    assert acc.device_type == "cuda" and acc.precision == "bf16-mixed" and acc.strategy == "ddp"
    assert repr(acc) == "TorchDeviceAccelerator(device_type='cuda', precision='bf16-mixed', strategy='ddp')"
    built = ACCELERATOR_REGISTRY.get("cpu", precision="64-true")
    assert isinstance(built, CPUAccelerator) and built.precision == "64-true" and built.name() == "cpu"


def test_an_accelerator_carrying_objects_pickles() -> None:
    # ddp_spawn pickles the Rig, and with it the accelerator and what it carries
    acc = CPUAccelerator(precision="bf16-mixed", strategy=DDPStrategy(find_unused_parameters=True))
    back = pickle.loads(pickle.dumps(acc))
    assert back.precision == "bf16-mixed" and repr(back.strategy) == "DDPStrategy(find_unused_parameters=True)"


# -- Rig and Trainer use it ------------------------------------------------------------------
def test_rig_uses_the_carried_names() -> None:
    rig = Rig(accelerator=CPUAccelerator(precision="bf16-mixed", strategy="single"))
    assert isinstance(rig.precision, Precision) and rig.precision.name == "bf16-mixed"
    assert isinstance(rig.strategy, SingleDeviceStrategy)
    model = rig.prepare(torch.nn.Linear(3, 2))
    assert model(torch.ones(1, 3)).dtype == torch.float32  # outputs cast back...
    with rig.autocast():
        assert model.module(torch.ones(1, 3)).dtype == torch.bfloat16  # ...from bf16 autocast


def test_rig_uses_the_carried_objects_themselves() -> None:
    precision = Precision(name="bf16-true", device_type="cpu")
    strategy = SingleDeviceStrategy()
    rig = Rig(accelerator=CPUAccelerator(precision_plugin=precision, training_type_plugin=strategy))
    assert rig.precision is precision and rig.strategy is strategy
    assert rig.strategy.precision is precision
    model = rig.prepare(torch.nn.Linear(3, 2))
    assert model.module.weight.dtype == torch.bfloat16


def test_a_user_accelerator_that_inherits_init_composes() -> None:
    rig = Rig(accelerator=_CPUBacked(precision="16-true", strategy=SingleDeviceStrategy()))
    assert rig.precision.name == "16-true" and isinstance(rig.strategy, SingleDeviceStrategy)
    own = _WithOwnInit(chip="x", training_type_plugin="single", precision_plugin="64-true")
    assert own.chip == "x"
    rig = Rig(accelerator=own)
    assert rig.precision.name == "64-true" and isinstance(rig.strategy, SingleDeviceStrategy)


def test_a_user_accelerator_that_skips_super_init_still_works_without_composition() -> None:
    acc = _NoSuperInit("x")
    assert acc.precision is None and acc.strategy is None and repr(acc) == "_NoSuperInit()"
    assert Rig(accelerator=acc).precision.name == "32-true"
    rig = Rig(accelerator=acc, precision="bf16-mixed", strategy="single")
    assert rig.precision.name == "bf16-mixed" and isinstance(rig.strategy, SingleDeviceStrategy)


def test_the_carried_value_comes_before_the_environment_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHRIG_PRECISION", "16-true")
    assert Rig(accelerator="cpu").precision.name == "16-true"
    assert Rig(accelerator=CPUAccelerator(precision="bf16-mixed")).precision.name == "bf16-mixed"
    assert Rig(accelerator=CPUAccelerator(strategy="single")).precision.name == "16-true"


def test_the_trainer_uses_what_the_accelerator_carries(tmp_path: Path) -> None:
    # The documents' shape: one accelerator object, handed to the Trainer alone.
    strategy = SingleDeviceStrategy()
    accelerator = CPUAccelerator(precision_plugin="bf16-mixed", training_type_plugin=strategy)
    seen: list[torch.dtype] = []

    class Net(torchrig.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self.layer(batch[0])
            seen.append(out.dtype)
            return out.float().pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = _quiet_trainer(tmp_path, accelerator=accelerator, max_steps=2)
    assert trainer.rig.strategy is strategy and trainer.rig.precision.name == "bf16-mixed"
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer.fit(Net(), train_dataloaders=data)
    assert seen == [torch.bfloat16, torch.bfloat16]


# -- conflicts -------------------------------------------------------------------------------
def test_rig_precision_that_disagrees_with_the_carried_one_names_both() -> None:
    with pytest.raises(ValueError, match="precision='32-true' was given, but the accelerator 'cpu' carries") as err:
        Rig(accelerator=CPUAccelerator(precision="bf16-mixed"), precision="32-true")
    assert "precision='bf16-mixed'" in str(err.value) and "give the precision in one place" in str(err.value)


def test_trainer_strategy_that_disagrees_with_the_carried_one_names_both(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="strategy='ddp' was given, but the accelerator 'cpu' carries strategy='single'"
    ):
        _quiet_trainer(tmp_path, accelerator=CPUAccelerator(strategy="single"), strategy="ddp")


def test_a_name_disagrees_with_an_object_of_other_settings() -> None:
    acc = CPUAccelerator(strategy=DDPStrategy(find_unused_parameters=True))
    with pytest.raises(ValueError, match=r"strategy='ddp' was given, .* carries strategy=DDPStrategy\(find_unused"):
        Rig(accelerator=acc, strategy="ddp")


def test_two_different_strategy_objects_disagree() -> None:
    acc = CPUAccelerator(strategy=SingleDeviceStrategy())
    with pytest.raises(ValueError, match=r"strategy=SingleDeviceStrategy\(\) \(a different object\)"):
        Rig(accelerator=acc, strategy=SingleDeviceStrategy())


def test_an_explicit_argument_equal_to_the_carried_one_is_fine() -> None:
    rig = Rig(
        accelerator=CPUAccelerator(precision="bf16-mixed", strategy="single"), precision="bf16", strategy="single"
    )
    assert rig.precision.name == "bf16-mixed" and isinstance(rig.strategy, SingleDeviceStrategy)
    strategy = SingleDeviceStrategy()
    rig = Rig(accelerator=CPUAccelerator(strategy=strategy), strategy="single")
    assert rig.strategy is strategy  # the name builds that object: the carried object is kept
    precision = Precision(name="16-true", device_type="cpu")
    strategy = SingleDeviceStrategy()  # an instance lays out one Rig's run (Strategy.bind)
    rig = Rig(accelerator=CPUAccelerator(precision=precision), precision="16-true", strategy=strategy)
    assert rig.precision is precision and rig.strategy is strategy


def test_precision_and_precision_plugin_that_disagree_name_both() -> None:
    with pytest.raises(ValueError, match="precision_plugin= is another name for precision=") as err:
        CPUAccelerator(precision="bf16-mixed", precision_plugin="16-mixed")
    assert "CPUAccelerator got precision='bf16-mixed' and precision_plugin='16-mixed'" in str(err.value)
    with pytest.raises(ValueError, match=r"_CPUBacked got strategy='single' and training_type_plugin=DDPStrategy\(\)"):
        _CPUBacked(strategy="single", training_type_plugin=DDPStrategy())


def test_a_pair_that_agrees_is_fine_and_keeps_the_object() -> None:
    assert CPUAccelerator(precision="bf16", precision_plugin="bf16-mixed").precision == "bf16-mixed"
    strategy = SingleDeviceStrategy()
    assert CPUAccelerator(strategy="single", training_type_plugin=strategy).strategy is strategy
    spawn = DDPStrategy(start_method="spawn")
    assert CPUAccelerator(strategy="ddp_spawn", training_type_plugin=spawn).strategy is spawn


def test_fp8_settings_are_part_of_the_precision() -> None:
    # FP8Mixed() is what "fp8-mixed" builds; one with its own layer filter asks for something else
    default = FP8Mixed()
    assert CPUAccelerator(precision="fp8-mixed", precision_plugin=default).precision is default
    assert CPUAccelerator(precision=FP8Mixed(), precision_plugin=FP8Mixed()).precision == FP8Mixed()
    picky = FP8Mixed(module_filter_fn=lambda module, fqn: fqn.startswith("blocks."))
    with pytest.raises(
        ValueError, match=r"got precision=FP8Mixed\(module_filter_fn=<function .* and precision_plugin='fp8"
    ):
        CPUAccelerator(precision=picky, precision_plugin="fp8-mixed")
    with pytest.raises(
        ValueError, match="precision='bf16-mixed' was given, but the accelerator 'cpu' carries precision=FP8"
    ):
        Rig(accelerator=CPUAccelerator(precision=picky), precision="bf16-mixed")


# -- bad input -------------------------------------------------------------------------------
def test_bad_carried_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown precision='bf17'.*Did you mean 'bf16-mixed'"):
        CPUAccelerator(precision="bf17")
    with pytest.raises(ValueError, match="unknown precision_plugin='bf17'"):
        CPUAccelerator(precision_plugin="bf17")
    with pytest.raises(ValueError, match=r"strategy='dpp': unknown strategy 'dpp'; known: ddp.*Did you mean 'ddp'"):
        CPUAccelerator(strategy="dpp")
    with pytest.raises(TypeError, match=r"precision=1.5 must be a precision name \(32-true.*a torchrig.Precision or a"):
        CPUAccelerator(precision=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"training_type_plugin=3 must be a strategy name \(ddp.*or a Strategy"):
        CPUAccelerator(training_type_plugin=3)  # type: ignore[arg-type]


def test_a_precision_object_for_another_device_type_is_refused() -> None:
    precision = Precision(name="32-true", device_type="cuda")
    with pytest.raises(ValueError, match="was made for cuda, but this run's devices are cpu; pass precision='32-true'"):
        Rig(accelerator=CPUAccelerator(precision=precision))
    with pytest.raises(ValueError, match="was made for cuda"):
        Rig(accelerator="cpu", precision=precision)


# -- two processes: DDP carried by the accelerator -------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_ddp_carried_by_the_accelerator_trains_two_rig_processes_like_one(tmp_path: Path) -> None:
    from dist_helpers import SCRIPTS, assert_matches_reference, explain, result, run

    out = tmp_path / "w.pt"
    proc = run([str(SCRIPTS / "composed.py"), "--out", str(out), "--form", "rig"], timeout=80)
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    assert info == {"world_size": 2, "strategy": "DDPStrategy", "precision": "32-true", "carried_objects_used": True}
    assert_matches_reference(weights)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_the_documents_example_fits_on_two_trainer_processes(tmp_path: Path) -> None:
    # Trainer(accelerator=CPUAccelerator(precision_plugin="bf16-mixed", training_type_plugin=DDPStrategy()), devices=2)
    from dist_helpers import SCRIPTS, explain, run

    out = tmp_path / "w.pt"
    proc = run([str(SCRIPTS / "composed.py"), "--out", str(out), "--form", "trainer"], timeout=80)
    assert proc.returncode == 0, explain(proc)
    infos = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    for info in infos:
        assert info["world_size"] == 2 and info["strategy"] == "DDPStrategy" and info["carried_strategy_used"]
        assert info["precision"] == "bf16-mixed" and info["dtypes"] == ["torch.bfloat16"] and info["global_step"] == 3
    # the ranks started from different weights (their own seeds): DDP made and kept them equal
    w0, w1 = (torch.load(f"{out}.rank{r}.pt") for r in (0, 1))
    assert sorted(w0) == ["layer.bias", "layer.weight"]
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
