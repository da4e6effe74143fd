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


def _gan() -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """A generator G (2 -> 3) and a discriminator D (3 -> 1)."""
    torch.manual_seed(1)
    return torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)


def _gans() -> tuple[torchrig.Rig, DeferredUpdateGradScaler, tuple[Any, ...], tuple[Any, ...]]:
    """A 16-mixed Rig, its scaler (every update without an inf doubles the scale), and two copies
    of one GAN with SGD optimizers: (G, D, G's, D's) prepared by the Rig, and the same unprepared."""
    rig = torchrig.Rig(accelerator="cpu", precision="16-mixed")
    g, d = _gan()
    g_ref, d_ref = copy.deepcopy(g), copy.deepcopy(d)
    opt_d, opt_g = rig.prepare(torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1))
    ref_d, ref_g = torch.optim.SGD(d_ref.parameters(), lr=0.1), torch.optim.SGD(g_ref.parameters(), lr=0.1)
    scaler = _scaler(rig.precision)
    scaler.set_growth_interval(1)
    return rig, scaler, (g, d, opt_g, opt_d), (g_ref, d_ref, ref_g, ref_d)


def _d_loss(d: torch.nn.Module, g: torch.nn.Module, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return (d(real) - 1).pow(2).mean() + d(g(z).detach()).pow(2).mean()


def _g_loss(d: torch.nn.Module, g: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    return (d(g(z)) - 1).pow(2).mean()


def test_a_gan_d_step_then_g_step_updates_the_scale_once_per_iteration_like_pytorchs_recipe() -> None:
    # The D-step's update used to run at the G-step's backward: two updates per iteration.
    rig, scaler, (g, d, opt_g, opt_d), (g_ref, d_ref, ref_g, ref_d) = _gans()
    ref = torch.amp.GradScaler("cpu", growth_interval=1)
    data = torch.Generator().manual_seed(2)
    ours, theirs = [], []
    for i in range(5):
        real, z = torch.randn(4, 3, generator=data), torch.randn(4, 2, generator=data)
        rig.backward(_d_loss(d, g, real, z))
        ref.scale(_d_loss(d_ref, g_ref, real, z)).backward()
        if i == 2:  # D overflows once: its step is skipped and the scale backs off
            d.weight.grad[0, 0] = d_ref.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        opt_d.step()
        ref.step(ref_d)
        opt_d.zero_grad(), ref_d.zero_grad(), opt_g.zero_grad(), ref_g.zero_grad()
        rig.backward(_g_loss(d, g, z))
        ref.scale(_g_loss(d_ref, g_ref, z)).backward()
        opt_g.step()
        ref.step(ref_g)
        ref.update()  # once, after both optimizers stepped
        opt_d.zero_grad(), ref_d.zero_grad(), opt_g.zero_grad(), ref_g.zero_grad()
        ours.append(scaler.get_scale())
        theirs.append(ref.get_scale())
    assert theirs == [2.0**17, 2.0**18, 2.0**17, 2.0**18, 2.0**19]
    assert ours == theirs  # was 2**18 after the first iteration, 2**24 after the fifth
    for p, q in zip([*d.parameters(), *g.parameters()], [*d_ref.parameters(), *g_ref.parameters()], strict=True):
        assert torch.equal(p, q)


def test_a_critic_stepping_twice_per_generator_step_unscales_each_step_with_its_own_scale() -> None:
    # D steps again before the round {D, G} is complete: that ends the round (one update), after
    # D's new gradients were unscaled with the scale they were scaled with. Power-of-two scales on
    # fp32 losses cancel exactly, so the training equals the same loop without a scaler.
    rig, scaler, (g, d, opt_g, opt_d), (g_ref, d_ref, ref_g, ref_d) = _gans()
    data = torch.Generator().manual_seed(3)
    scales = []
    for _ in range(3):
        z = torch.randn(4, 2, generator=data)
        for _ in range(2):  # two critic steps
            real = torch.randn(4, 3, generator=data)
            for model_d, model_g, opt, backward in ((d, g, opt_d, rig.backward), (d_ref, g_ref, ref_d, None)):
                loss = _d_loss(model_d, model_g, real, z)
                loss.backward() if backward is None else backward(loss)
                if backward is not None:
                    rig.clip_gradients(d, opt, max_norm=1e9)  # unscales here, before the step
                opt.step()
                opt.zero_grad()
        rig.backward(_g_loss(d, g, z))
        _g_loss(d_ref, g_ref, z).backward()
        opt_g.step()
        ref_g.step()
        opt_g.zero_grad(), ref_g.zero_grad(), opt_d.zero_grad(), ref_d.zero_grad()
        scales.append(scaler.get_scale())
    assert scales == [2.0**18, 2.0**20, 2.0**22]  # two updates per iteration: one per critic round
    for p, q in zip([*d.parameters(), *g.parameters()], [*d_ref.parameters(), *g_ref.parameters()], strict=True):
        assert torch.equal(p, q)


def test_the_grad_scaler_settings_are_an_argument_of_the_precision() -> None:
    settings = {"init_scale": 256.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3}
    precision = Precision(name="16-mixed", device_type="cpu", grad_scaler=settings)
    rig = torchrig.Rig(accelerator="cpu", precision=precision)
    scaler = _scaler(rig.precision)
    assert rig.precision is precision
    assert scaler.get_scale() == 256.0 and scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25 and scaler.get_growth_interval() == 3
    trainer = torchrig.Trainer(
        accelerator="cpu",
        precision=Precision(name="16-mixed", device_type="cpu", grad_scaler={"init_scale": 8.0}),
        logger=False,
        enable_checkpointing=False,
    )
    assert _scaler(trainer.rig.precision).get_scale() == 8.0


@pytest.mark.parametrize(
    ("name", "settings", "error", "message"),
    [
        (
            "bf16-mixed",
            {"init_scale": 8.0},
            ValueError,
            "grad_scaler={'init_scale': 8.0} sets the GradScaler of precision='16-mixed', but "
            "precision='bf16-mixed' has none; drop grad_scaler, or use precision='16-mixed'",
        ),
        (
            "16-mixed",
            {"init_scale": 8.0, "growth": 2},
            TypeError,
            "grad_scaler has unknown setting(s) growth; it takes init_scale, growth_factor, backoff_factor, "
            "growth_interval",
        ),
        ("16-mixed", {"init_scale": -1.0}, ValueError, "grad_scaler['init_scale']=-1.0 must be a number > 0"),
        (
            "16-mixed",
            {"growth_factor": 0.5},
            ValueError,
            "grad_scaler={'growth_factor': 0.5}: growth_factor must be > 1 and backoff_factor < 1 (the defaults "
            "are 2.0 and 0.5)",
        ),
        (
            "16-mixed",
            [("init_scale", 8.0)],
            TypeError,
            "grad_scaler=[('init_scale', 8.0)] must be a dict of GradScaler settings such as "
            "{'init_scale': 1024.0, 'growth_interval': 100}",
        ),
    ],
)
def test_bad_grad_scaler_settings_are_refused(name: str, settings: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as err:
        Precision(name=name, device_type="cpu", grad_scaler=settings)
    assert str(err.value) == message
