"""Device and dtype mismatches inside a prepared forward explain themselves (real errors, on CPU).

``meta`` tensors and a second dtype make genuine mismatches without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchrig
from torchrig import DeviceMismatchError
from torchrig.diagnostics import is_mismatch

pytestmark = pytest.mark.timeout(10)


def _prepared(module: nn.Module) -> nn.Module:
    return torchrig.Rig(accelerator="cpu", devices=1).prepare(module)  # type: ignore[no-any-return]


def _raise(model: nn.Module, *args: object) -> DeviceMismatchError:
    with pytest.raises(DeviceMismatchError) as info:
        model(*args)
    err = info.value
    assert isinstance(err, RuntimeError)  # still caught by `except RuntimeError`
    assert isinstance(err.__cause__, RuntimeError) and not isinstance(err.__cause__, DeviceMismatchError)
    assert str(err).splitlines()[0] == str(err.__cause__).splitlines()[0]  # the original message first
    return err


def test_input_of_a_second_dtype_names_the_input_and_the_fix() -> None:
    model = _prepared(nn.Linear(4, 2))
    message = str(_raise(model, torch.randn(3, 4, dtype=torch.float64)))
    assert "mat1 and mat2 must have the same dtype" in message
    assert "on cpu float32: parameter weight, parameter bias" in message
    assert "on cpu float64: input 0" in message
    assert "the inputs and weights have different dtypes" in message


def test_submodule_added_after_prepare_is_named() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head: nn.Module = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    model = _prepared(Net())
    model.head = nn.Linear(4, 2, device="meta")  # created after prepare, somewhere else
    message = str(_raise(model, torch.randn(3, 4)))
    assert "is not on the expected device" in message
    assert "on meta float32: parameter head.weight, parameter head.bias" in message
    assert "on cpu float32: parameter body.weight, parameter body.bias, input 0" in message
    assert "2 parameter(s)/buffer(s) are not on cpu (parameter head.weight ...)" in message
    assert "created or moved after rig.prepare()" in message


def test_tensor_created_in_forward_without_device_is_explained() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            offset = torch.zeros(4, device="meta")  # stands for a forgotten device=x.device
            return self.layer(x) + offset

    message = str(_raise(_prepared(Net()), torch.randn(2, 4)))
    assert "every parameter, buffer and input is on cpu, so a tensor created inside forward()" in message
    assert "create it with device=x.device" in message


def test_input_not_from_a_prepared_loader_is_explained() -> None:
    model = _prepared(nn.Linear(4, 2))
    message = str(_raise(model, {"features": torch.randn(2, 4, device="meta")}["features"]))
    assert "on meta float32: input 0" in message
    assert "1 input(s) are not on cpu (input 0 ...): the batch did not come from a prepared dataloader" in message
    assert "rig.to_device(batch)" in message


def test_keyword_and_nested_inputs_are_named() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.layer(batch["x"])

    message = str(_raise(_prepared(Net()), {"x": torch.randn(2, 4, dtype=torch.float64)}))
    assert "on cpu float64: input 0['x']" in message


def test_other_errors_pass_through_untouched() -> None:
    model = _prepared(nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as info:
        model(torch.randn(3, 5))
    assert type(info.value) is RuntimeError


def test_known_mismatch_messages_are_recognised() -> None:
    for text in (
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
        "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same",
        "Tensor on device meta is not on the expected device cpu!",
        "Placeholder storage has not been allocated on MPS device!",
        "expected scalar type Float but found Double",
        "mixed dtype (CPU): all inputs must share same datatype.",
    ):
        assert is_mismatch(RuntimeError(text)), text
    assert not is_mismatch(RuntimeError("CUDA out of memory"))
    assert not is_mismatch(ValueError("Expected all tensors to be on the same device"))


class _Stepper(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        return self.net(torch.randn(3, 4, dtype=torch.float64)).sum()  # a second dtype, inside the step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_mismatch_inside_a_training_step_called_directly_is_explained() -> None:
    # One device, 32-true, no hooks: the Trainer calls training_step without the forward wrapper.
    prepared = _prepared(_Stepper())
    assert prepared._rig_plain
    with pytest.raises(DeviceMismatchError, match=r"so a tensor created inside forward\(\) is elsewhere"):
        prepared.step_caller(prepared.module.training_step)(None, 0)


def test_module_hooks_still_see_a_step_run_as_forward() -> None:
    prepared = _prepared(_Stepper())
    seen: list[str] = []
    prepared.module.register_forward_pre_hook(lambda mod, args: seen.append(type(mod).__name__))
    with pytest.raises(DeviceMismatchError):
        prepared.step_caller(prepared.module.training_step)(None, 0)
    assert seen == ["_Stepper"]  # the step went through the module's __call__, hooks and all


def test_step_caller_explains_a_mismatch_and_follows_hooks_registered_later() -> None:
    """The Trainer's per-epoch caller: a direct call while no hook exists; a hook registered
    after it was made (on the module, or globally) is seen from the next call on."""
    prepared = _prepared(_Stepper())
    call = prepared.step_caller(prepared.module.training_step)
    with pytest.raises(DeviceMismatchError, match=r"so a tensor created inside forward\(\) is elsewhere"):
        call(None, 0)
    seen: list[str] = []
    handle = prepared.module.register_forward_pre_hook(lambda mod, args: seen.append("module"))
    with pytest.raises(DeviceMismatchError):
        call(None, 0)
    assert seen == ["module"]
    handle.remove()
    glob = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: seen.append(type(mod).__name__))
    try:
        with pytest.raises(DeviceMismatchError):
            call(None, 0)
    finally:
        glob.remove()
    assert seen[1] == "_Stepper"  # the step ran as the module's forward (then its Linear, also hooked)
    with pytest.raises(DeviceMismatchError):
        call(None, 0)
    assert seen.count("_Stepper") == 1  # hooks removed: the direct call again
