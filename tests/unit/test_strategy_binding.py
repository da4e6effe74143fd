"""Issue 19 #6/#7: a strategy gets its run through ``Strategy.bind`` once; the loader a batch came
from is known to the Rig (``Rig.current_loader``); one lookup of a device module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchrig
from torchrig import Rig
from torchrig.accelerators import CPUAccelerator
from torchrig.data import RigDataLoader
from torchrig.devices import device_module
from torchrig.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

_REUSED = r"is already used by another Rig or Trainer.*Give each Rig/Trainer its own instance \({}\(\.\.\.\)\)"


def test_a_strategy_instance_is_bound_to_the_plan_of_its_rig() -> None:
    strategy = SingleDeviceStrategy()
    rig = Rig(accelerator="cpu", strategy=strategy, precision="bf16-mixed")
    assert rig.strategy is strategy
    assert strategy.accelerator is rig.accelerator and strategy.precision is rig.precision
    assert strategy.parallel_devices == list(rig.plan.devices) == [torch.device("cpu")]
    assert strategy.num_nodes == rig.plan.num_nodes == 1


def test_a_second_rig_refuses_a_strategy_instance_and_names_what_to_do() -> None:
    strategy = SingleDeviceStrategy()
    first = Rig(accelerator="cpu", strategy=strategy, precision="bf16-mixed")
    with pytest.raises(ValueError, match=_REUSED.format("SingleDeviceStrategy")) as err:
        Rig(accelerator="cpu", strategy=strategy, precision="64-true")
    assert "strategy=SingleDeviceStrategy()" in str(err.value) and "'ddp'" in str(err.value)
    # the refused Rig changed nothing: the strategy still lays out the first Rig's run
    assert strategy.precision is first.precision and first.precision.name == "bf16-mixed"
    with pytest.raises(ValueError, match=_REUSED.format("DDPStrategy")):
        shared = DDPStrategy(find_unused_parameters=True)
        torchrig.resolve(accelerator="cpu", devices=2, strategy=shared)
        torchrig.resolve(accelerator="cpu", devices=2, strategy=shared)


def test_strategies_built_from_names_are_new_for_every_rig() -> None:
    a, b = Rig(accelerator="cpu", strategy="single"), Rig(accelerator="cpu", strategy="single")
    assert a.strategy is not b.strategy and a.strategy.accelerator is a.accelerator


def test_a_strategy_carried_by_an_accelerator_serves_one_rig() -> None:
    acc = CPUAccelerator(strategy=SingleDeviceStrategy())
    Rig(accelerator=acc)
    with pytest.raises(ValueError, match=_REUSED.format("SingleDeviceStrategy")):
        Rig(accelerator=acc)
    # an accelerator carrying a name builds a new strategy each time
    named = CPUAccelerator(strategy="single")
    assert Rig(accelerator=named).strategy is not Rig(accelerator=named).strategy


def test_bind_is_the_one_place_a_strategy_gets_its_run() -> None:
    seen: list[dict[str, Any]] = []

    class Recording(SingleDeviceStrategy):
        def bind(self, **run: Any) -> None:
            seen.append(run)
            super().bind(**run)

    plan = torchrig.resolve(accelerator="cpu", strategy=Recording(), precision="16-true", num_nodes=1)
    assert seen == [
        {"accelerator": plan.accelerator, "devices": list(plan.devices), "precision": plan.precision, "num_nodes": 1}
    ]


def test_a_strategy_subclass_without_init_still_binds_once() -> None:
    class Bare(Strategy):
        def __init__(self) -> None:  # skips Strategy.__init__
            pass

    bare = Bare()
    plan = torchrig.resolve(accelerator="cpu", strategy=bare)
    assert bare.root_device == torch.device("cpu") and bare.accelerator is plan.accelerator
    with pytest.raises(ValueError, match=_REUSED.format("Bare")):
        torchrig.resolve(accelerator="cpu", strategy=bare)


def test_current_loader_is_the_prepared_loader_that_yielded_last() -> None:
    rig = Rig(accelerator="cpu")
    assert rig.current_loader is None
    first = rig.prepare(DataLoader(list(range(4)), batch_size=2))
    second = rig.prepare(DataLoader(list(range(6)), batch_size=3))
    assert rig.current_loader is None  # preparing yields nothing
    from_first, from_second = iter(first), iter(second)
    seen = []
    for batches in (from_first, from_second, from_first, from_second):
        next(batches)
        seen.append(rig.current_loader)
    assert seen == [first, second, first, second]


def test_a_rig_data_loader_calls_on_batch_before_each_batch() -> None:
    calls: list[tuple[RigDataLoader, int]] = []
    loader = RigDataLoader(
        DataLoader(list(range(5)), batch_size=2),
        device=torch.device("cpu"),
        on_batch=lambda source: calls.append((source, source.batches_seen)),
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert calls == [(loader, 1), (loader, 2), (loader, 3)]
    assert [b.tolist() for b in RigDataLoader(DataLoader([7]), device=torch.device("cpu"))] == [[7]]


def test_device_module_is_the_module_torch_has_or_none() -> None:
    assert device_module("cpu") is torch.cpu
    assert device_module("cuda") is torch.cuda
    assert device_module("meta") is None  # a device type without a module
    assert device_module("no_such_device") is None  # a name torch does not know


@pytest.mark.parametrize("strategy", ["single", SingleDeviceStrategy], ids=["name", "instance"])
@pytest.mark.parametrize("make", [Rig, torchrig.Trainer], ids=["Rig", "Trainer"])
def test_single_with_several_devices_is_refused_by_name_and_as_an_instance(strategy: Any, make: Any) -> None:
    """The instance ran one process as world size 1, silently dropping the second device."""
    given = "'single'" if isinstance(strategy, str) else r"SingleDeviceStrategy\(\)"
    with pytest.raises(
        ValueError,
        match=rf"^strategy={given} runs one process on one device, but 2 device\(s\) on 1 node\(s\) were asked for; "
        r"use strategy='ddp' \(or 'fsdp'\), or devices=1$",
    ):
        make(accelerator="cpu", devices=2, strategy=strategy if isinstance(strategy, str) else strategy())
