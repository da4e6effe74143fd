"""16-mixed with several optimizers: the GradScaler updates once per iteration, after all stepped.

16-mixed runs on the CPU (``torch.amp.GradScaler("cpu")``), so these tests use it directly. The
losses are computed in fp32 (no autocast) so the scaled gradients are exact multiples of the
unscaled ones and can be compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

import torchrig
from torchrig.precision import DeferredUpdateGradScaler, Precision

pytestmark = pytest.mark.timeout(30)


def _scaler(precision: Precision) -> DeferredUpdateGradScaler:
    assert isinstance(precision.scaler, DeferredUpdateGradScaler)
    return precision.scaler


def _two_layers() -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)


def _loss(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return b(torch.tanh(a(x))).pow(2).mean()


def test_two_prepared_optimizers_update_the_scale_once_per_iteration_after_both_stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="16-mixed")
    a, b = _two_layers()
    model = rig.prepare(torch.nn.Sequential(a, torch.nn.Tanh(), b))
    opt_a, opt_b = rig.prepare(torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1))
    scaler = _scaler(rig.precision)
    real_update = scaler.update
    stages_at_update: list[list[str]] = []

    def spy(new_scale: Any = None) -> None:
        states = scaler._per_optimizer_states
        stages_at_update.append([states[id(o.optimizer)]["stage"].name for o in (opt_a, opt_b)])
        real_update(new_scale)

    monkeypatch.setattr(scaler, "update", spy)
    x = torch.full((2, 4), 0.01)
    updates_after_steps = []
    for _ in range(3):
        rig.backward(model(x).mean())
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        updates_after_steps.append(len(stages_at_update))
    # each iteration's update runs at the next backward, not between the two steps
    assert updates_after_steps == [0, 1, 2]
    scaler.get_scale()  # reading the scale applies the last iteration's update
    assert stages_at_update == [["STEPPED", "STEPPED"]] * 3


def test_an_inf_in_the_first_optimizer_does_not_change_the_scale_the_second_is_unscaled_with() -> None:
    precision = Precision(name="16-mixed", device_type="cpu")
    scaler = _scaler(precision)
    a, b = _two_layers()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    b_before = [p.detach().clone() for p in b.parameters()]
    a_before = [p.detach().clone() for p in a.parameters()]
    precision.backward(_loss(a, b, torch.randn(5, 4)))
    old_scale = scaler.get_scale()
    scaled_b = [p.grad.clone() for p in b.parameters()]  # type: ignore[union-attr]
    a.weight.grad[0, 0] = float("inf")  # type: ignore[index]

    precision.optimizer_step(opt_a)  # skipped: inf
    precision.unscale_gradients(opt_b)  # what clip_gradients does before clipping opt_b
    for p, g in zip(b.parameters(), scaled_b, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g / old_scale)  # the scale the loss had
    precision.optimizer_step(opt_b)

    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), a_before, strict=True))  # a skipped
    for p, before, g in zip(b.parameters(), b_before, scaled_b, strict=True):  # b stepped, right size
        torch.testing.assert_close(p.detach(), before - 0.1 * (g / old_scale))
    assert scaler.get_scale() == old_scale * scaler.get_backoff_factor()  # backed off once
    assert scaler.state_dict()["_growth_tracker"] == 0


def _recipe_scales() -> tuple[list[float], list[float], torch.nn.Module, torch.nn.Module]:
    """Scales used by each iteration: torchrig's precision and PyTorch's own recipe, side by side."""
    precision = Precision(name="16-mixed", device_type="cpu")
    ours = _scaler(precision)
    ours.set_growth_interval(2)  # so growth happens within a few iterations
    ref = torch.amp.GradScaler("cpu", growth_interval=2)
    torch.manual_seed(0)
    model_ours = torch.nn.Linear(4, 1)
    model_ref = copy.deepcopy(model_ours)
    opt_ours = torch.optim.SGD(model_ours.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(model_ref.parameters(), lr=0.01)
    scales_ours, scales_ref = [], []
    for i in range(9):
        x = torch.randn(3, 4)
        precision.backward(model_ours(x).pow(2).mean())
        ref.scale(model_ref(x).pow(2).mean()).backward()
        scales_ours.append(float(ours._scale))  # type: ignore[arg-type]
        scales_ref.append(float(ref._scale))  # type: ignore[arg-type]
        if i in (3, 4, 7):
            model_ours.weight.grad[0, 1] = float("inf")  # type: ignore[index]
            model_ref.weight.grad[0, 1] = float("inf")  # type: ignore[index]
        precision.optimizer_step(opt_ours)
        ref.step(opt_ref)
        ref.update()
        opt_ours.zero_grad()
        opt_ref.zero_grad()
    scales_ours.append(ours.get_scale())
    scales_ref.append(ref.get_scale())
    return scales_ours, scales_ref, model_ours, model_ref


def test_one_optimizer_gets_the_scale_sequence_of_pytorchs_recipe() -> None:
    ours, ref, model_ours, model_ref = _recipe_scales()
    assert ours == ref
    assert len(set(ours)) > 2  # it grew and backed off
    assert all(torch.equal(p, q) for p, q in zip(model_ours.parameters(), model_ref.parameters(), strict=True))


def test_state_dict_after_a_step_holds_the_updated_scale() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="16-mixed")
    model = torch.nn.Linear(4, 1, bias=False)
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = _scaler(rig.precision)
    scaler.set_growth_interval(1)
    x = torch.full((2, 4), 0.01)

    rig.backward(model(x).mean())
    start = scaler.get_scale()
    model.weight.grad[0, 0] = float("inf")
    optimizer.step()
    assert rig.precision.state_dict()["scale"] == start / 2  # backed off
    optimizer.zero_grad()

    rig.backward(model(x).mean())
    optimizer.step()
    state = rig.precision.state_dict()
    assert state["scale"] == start  # grew again (growth_interval=1)
    assert state["_growth_tracker"] == 0
    assert scaler.state_dict() == state  # the same through the scaler itself


def test_an_explicit_update_after_the_step_is_the_deferred_one_not_a_second() -> None:
    precision = Precision(name="16-mixed", device_type="cpu")
    scaler = _scaler(precision)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.backward(model(torch.randn(2, 4)).sum())
    model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    start = scaler.get_scale()
    precision.optimizer_step(optimizer)
    scaler.update()  # PyTorch's recipe, as a user might still write it
    precision.backward(model(torch.randn(2, 4)).sum())  # nothing left to apply here
    assert scaler.get_scale() == start / 2


def test_loading_or_pickling_the_scaler_between_iterations_applies_the_due_update_first() -> None:
    precision = Precision(name="16-mixed", device_type="cpu")
    scaler = _scaler(precision)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.backward(model(torch.randn(2, 4)).sum())
    model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    precision.optimizer_step(optimizer)

    copied = pickle.loads(pickle.dumps(scaler))  # GradScaler refuses to pickle mid-iteration
    assert copied.get_scale() == scaler.get_scale() == 2.0**15

    saved = {**scaler.state_dict(), "scale": 8.0}
    precision.backward(model(torch.randn(2, 4)).sum())
    model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    precision.optimizer_step(optimizer)
    precision.load_state_dict(saved)  # while the inf iteration's update is due
    precision.backward(model(torch.randn(2, 4)).sum())  # the loaded scale is not backed off
    assert scaler.get_scale() == 8.0
