"""Every precision on the CPU: it trains, it is what was asked, and never silently fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchrig
from torchrig import precision as precision_mod
from torchrig.precision import Precision, auto_precision, normalize_precision, supported_precisions

pytestmark = pytest.mark.timeout(30)


def _train(precision: str, steps: int = 40) -> tuple[float, torchrig.Rig, torch.nn.Module]:
    torchrig.seed_everything(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)
    rig = torchrig.Rig(accelerator="cpu", devices=1, precision=precision)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, optimizer = rig.prepare(model, torch.optim.Adam(model.parameters(), lr=0.02))
    for _ in range(steps):
        out = model(x)
        loss = F.mse_loss(out, y.to(out.dtype))
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        out = model(x)
        final = F.mse_loss(out.double(), y.double()).item()
    return final, rig, model


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed"])
def test_mixed_precisions_train_to_a_loss_close_to_fp32(name: str) -> None:
    fp32, _, _ = _train("32-true")
    mixed, rig, model = _train(name)
    assert rig.precision.name == name
    assert mixed < 0.5 * _initial_loss()  # it learned
    assert mixed == pytest.approx(fp32, rel=0.25, abs=0.02)
    assert model.module[0].weight.dtype == torch.float32  # mixed keeps fp32 master weights


@pytest.mark.parametrize(("name", "dtype"), [("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_true_precisions_hold_parameters_in_their_dtype_and_train(name: str, dtype: torch.dtype) -> None:
    final, _, model = _train(name)
    assert all(p.dtype == dtype for p in model.parameters())
    assert final < 0.5 * _initial_loss()


def test_16_true_converts_parameters_and_inputs_to_fp16() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="16-true")
    model = rig.prepare(torch.nn.Linear(4, 2))
    out = model(torch.randn(3, 4))  # an fp32 input is cast to fp16 for the fp16 weights
    assert model.weight.dtype == torch.float16
    assert out.dtype == torch.float32  # and the output comes back in fp32 for the loss


def test_mixed_precision_forward_autocasts_and_returns_fp32() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="bf16-mixed")
    seen: list[torch.dtype] = []
    model = torch.nn.Linear(4, 2)
    model.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = rig.prepare(model)(torch.randn(3, 4))
    assert seen == [torch.bfloat16]  # computed under autocast
    assert out.dtype == torch.float32
    with rig.autocast():
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16


def test_a_call_under_autocast_keeps_half_outputs_and_the_loss_matches() -> None:
    """Under ``rig.autocast()`` the loss runs under autocast too (log_softmax upcasts inside its
    kernel), so the forward skips its float32 copy of the output; the loss is the same."""
    rig = torchrig.Rig(accelerator="cpu", precision="bf16-mixed")
    torch.manual_seed(0)
    model = rig.prepare(torch.nn.Linear(16, 50))
    x, target = torch.randn(8, 16), torch.randint(0, 50, (8,))
    outside = model(x)
    with rig.autocast():
        inside = model(x)
        loss_inside = F.cross_entropy(inside, target)
    assert outside.dtype == torch.float32
    assert inside.dtype == torch.bfloat16
    assert loss_inside.dtype == torch.float32  # cross_entropy is an fp32 op under autocast
    assert loss_inside.item() == pytest.approx(F.cross_entropy(outside, target).item(), rel=1e-6)
    grads = [torch.autograd.grad(loss, model.weight)[0] for loss in (loss_inside, F.cross_entropy(outside, target))]
    torch.testing.assert_close(grads[0], grads[1], rtol=0.02, atol=1e-3)
    with torch.autocast("cpu", enabled=False):  # autocast switched off again: converted again
        assert model(x).dtype == torch.float32


def _initial_loss() -> float:
    torchrig.seed_everything(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def test_grad_scaler_skips_a_step_with_an_inf_gradient_and_lowers_the_scale() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="16-mixed")
    model = torch.nn.Linear(4, 1, bias=False)  # a bias gradient equals the scale: inf in fp16
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = rig.precision.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    scale_before = scaler.get_scale()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((2, 4), 0.01)  # small enough that the scaled fp16 gradients stay finite
    rig.backward(model(x).mean())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.weight.grad[0, 0] = float("inf")
    optimizer.step()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # the step was skipped
    assert scaler.get_scale() < scale_before
    # the next, finite step goes through
    optimizer.zero_grad()
    rig.backward(model(x).mean())
    optimizer.step()
    assert not torch.equal(model.weight, before[0])
    assert scaler.get_scale() == scale_before / 2


def test_aliases_map_to_canonical_names() -> None:
    assert [normalize_precision(p) for p in (32, "16", "bf16", 64)] == ["32-true", "16-mixed", "bf16-mixed", "64-true"]


def test_unknown_precision_lists_choices_and_suggests() -> None:
    with pytest.raises(ValueError, match=r"unknown precision='bf16-mix'.*Did you mean 'bf16-mixed'"):
        torchrig.Rig(accelerator="cpu", precision="bf16-mix")
    with pytest.raises(TypeError, match="must be a string such as 'bf16-mixed'"):
        Precision(name=1.5, device_type="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("fp16", "16-mixed"),
        ("float16", "16-mixed"),
        ("bfloat16", "bf16-mixed"),
        ("fp32", "32-true"),
        ("bf17", "bf16-mixed"),
    ],
)
def test_other_tools_dtype_spellings_suggest_the_canonical_name(given: str, meant: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown precision='{given}'; choose from .* Did you mean '{meant}'\?$"):
        normalize_precision(given)


def test_unsupported_precision_errors_with_what_the_device_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_mod, "supported_precisions", lambda device_type: ["32-true", "64-true"])
    with pytest.raises(
        ValueError, match=r"precision='16-mixed' is not supported on cpu; cpu supports: 32-true, 64-true"
    ):
        torchrig.Rig(accelerator="cpu", precision="16-mixed")


def test_a_device_without_autocast_has_no_mixed_precision() -> None:
    # meta has no autocast: asking for mixed precision there must fail, not run in fp32.
    assert "16-mixed" not in supported_precisions("meta") and "32-true" in supported_precisions("meta")
    with pytest.raises(ValueError, match="not supported on meta; meta supports: 32-true"):
        Precision(name="bf16-mixed", device_type="meta")


def test_every_precision_is_supported_on_cpu() -> None:
    assert set(supported_precisions("cpu")) == set(torchrig.PRECISIONS)


def test_auto_picks_bf16_mixed_where_supported_else_32_true(monkeypatch: pytest.MonkeyPatch) -> None:
    assert auto_precision("cpu") == "32-true"
    assert torchrig.Rig(accelerator="cpu", precision="auto").precision.name == "32-true"
    monkeypatch.setattr(precision_mod, "supported_precisions", lambda t: ["32-true", "bf16-mixed"])
    assert auto_precision("cuda") == "bf16-mixed"
    monkeypatch.setattr(precision_mod, "supported_precisions", lambda t: ["32-true", "16-mixed"])
    assert auto_precision("cuda") == "32-true"


def test_16_mixed_rejects_a_closure() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="16-mixed")
    model = torch.nn.Linear(2, 1)
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="cannot step with a closure"):
        optimizer.step(lambda: model(torch.ones(1, 2)).sum())


_EPS_ZERO = (
    r"^AdamW\(eps=1e-08\) adds eps to parameters kept in torch.float16 \(precision='16-true'\), where 1e-08 is 0: a "
    r"parameter whose gradient is 0 would become NaN at its first step; pass eps=6.1e-05 or more, or use a precision "
    r"that keeps float32 parameters \('16-mixed', 'bf16-mixed'\)$"
)


def test_an_eps_that_is_zero_in_the_parameter_dtype_is_refused_at_prepare() -> None:
    """16-true with AdamW's default eps trained to NaN without a word (torchrig demo --precision 16-true: 10%)."""
    for order in ("model first", "optimizer first"):
        rig = torchrig.Rig(accelerator="cpu", precision="16-true")
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match=_EPS_ZERO):
            rig.prepare(model, optimizer) if order == "model first" else rig.prepare(optimizer, model)
    rig = torchrig.Rig(accelerator="cpu", precision="16-true")
    model = torch.nn.Linear(4, 2)
    model, optimizer = rig.prepare(model, torch.optim.AdamW(model.parameters(), eps=1e-4))
    model.weight.grad = torch.zeros_like(model.weight)  # the case eps=1e-8 turned into NaN
    model.bias.grad = torch.ones_like(model.bias)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for name in ("bf16-true", "16-mixed"):  # 1e-8 is not 0 in bfloat16; 16-mixed keeps float32 parameters
        rig = torchrig.Rig(accelerator="cpu", precision=name)
        model = torch.nn.Linear(4, 2)
        rig.prepare(model, torch.optim.AdamW(model.parameters()))


def test_the_trainer_refuses_it_before_the_first_step(tmp_path: object) -> None:
    class Module(torchrig.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            raise AssertionError("refused before the first step")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 4)), batch_size=2)
    trainer = torchrig.Trainer(accelerator="cpu", precision="16-true", logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=_EPS_ZERO):
        trainer.fit(Module(), data)
