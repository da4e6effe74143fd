"""Rig in one process: prepare, the step, clipping, accumulation, init_module and the errors."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.data import RigDataLoader
from torchrig.wrappers import RigModule, RigOptimizer

pytestmark = pytest.mark.timeout(20)


def _rig(**kwargs: object) -> torchrig.Rig:
    return torchrig.Rig(accelerator="cpu", devices=1, **kwargs)  # type: ignore[arg-type]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_properties_of_a_single_process_rig() -> None:
    rig = _rig()
    assert rig.device == torch.device("cpu")
    assert (rig.global_rank, rig.local_rank, rig.node_rank, rig.world_size) == (0, 0, 0, 1)
    assert rig.is_global_zero and rig.precision.name == "32-true"
    assert rig.accelerator.name() == "cpu"


def test_constructor_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        torchrig.Rig("cpu")  # type: ignore[misc]


def test_prepare_in_any_order_with_a_scheduler() -> None:
    rig = _rig()
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    out = rig.prepare(loader, scheduler, optimizer, model)
    assert isinstance(out[0], RigDataLoader) and out[1] is scheduler
    assert isinstance(out[2], RigOptimizer) and isinstance(out[2], torch.optim.SGD)
    assert isinstance(out[3], RigModule) and out[3].module is model
    assert rig.prepare(_mlp()).__class__ is RigModule  # one object in, one object out


def test_preparing_twice_is_an_error() -> None:
    rig = _rig()
    model = _mlp()
    prepared = rig.prepare(model)
    with pytest.raises(ValueError, match="Sequential was already prepared by this Rig; prepare each object once"):
        rig.prepare(model)
    with pytest.raises(ValueError, match="RigModule was already prepared"):
        _rig().prepare(prepared)


def test_setup_dataloader_makes_a_new_loader_each_time_and_leaves_the_loader_preparable() -> None:
    rig = _rig()
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4, shuffle=True)
    first, second = rig.setup_dataloader(loader), rig.setup_dataloader(loader)
    assert isinstance(first, RigDataLoader) and first is not second
    order = [b[0].tolist() for b in first]
    assert sorted(x for batch in order for x in batch) == list(range(16))
    prepared = rig.prepare(loader)  # not recorded as prepared by setup_dataloader
    assert isinstance(prepared, RigDataLoader)
    with pytest.raises(ValueError, match="DataLoader was already prepared by this Rig"):
        rig.prepare(loader)
    with pytest.raises(TypeError, match=r"setup_dataloader\(\) takes a torch.utils.data.DataLoader; got list"):
        rig.setup_dataloader([1, 2])  # type: ignore[arg-type]


def test_preparing_an_unknown_object_is_an_error() -> None:
    with pytest.raises(TypeError, match=r"prepare\(\) got a builtins.str; it takes nn.Module, torch.optim.Optimizer"):
        _rig().prepare("model")
    with pytest.raises(ValueError, match=r"prepare\(\) needs at least one module"):
        _rig().prepare()


def test_prepared_module_forwards_attributes_and_state_dict() -> None:
    rig = _rig()
    model = _mlp()
    prepared = rig.prepare(model)
    assert prepared.state_dict().keys() == model.state_dict().keys()  # no wrapper prefix
    assert getattr(prepared, "0") is model[0]  # submodules and attributes of the module
    prepared.extra_flag = 3  # attributes set on the wrapper land on the module that runs
    assert model.extra_flag == 3  # type: ignore[attr-defined]
    calls: list[int] = []
    prepared.register_forward_hook(lambda m, i, o: calls.append(1))
    prepared(torch.randn(2, 4))
    assert calls == [1]  # hooks on the wrapper itself fire


def test_optimizer_proxy_state_dict_round_trip() -> None:
    rig = _rig()
    model = _mlp()
    model, optimizer = rig.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.optimizer.__class__ is torch.optim.Adam
    rig.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    assert state["state"][0]["exp_avg"].shape == (8, 4)
    other = _mlp()
    other_opt = _rig().prepare(torch.optim.Adam(other.parameters(), lr=0.5))
    other_opt.load_state_dict(state)
    assert other_opt.param_groups[0]["lr"] == 0.01
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


@pytest.mark.parametrize("when", ["before", "after"])
def test_lr_scheduler_before_or_after_prepare_works_without_warnings(when: str) -> None:
    rig = _rig()
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if when == "before":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            model, optimizer, scheduler = rig.prepare(model, optimizer, scheduler)
        else:
            model, optimizer = rig.prepare(model, optimizer)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for _ in range(3):
            rig.backward(model(torch.randn(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_accumulating_four_micro_batches_equals_one_step_on_the_4x_batch() -> None:
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    torch.manual_seed(1)
    reference = _mlp()
    start = copy.deepcopy(reference.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()

    rig = _rig()
    model = _mlp()
    model.load_state_dict(start)
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for i, (xb, yb) in enumerate(zip(x.chunk(4), y.chunk(4), strict=True)):
        with rig.no_backward_sync(model, enabled=i < 3):
            rig.backward(F.mse_loss(model(xb), yb) / 4)
    optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_no_backward_sync_needs_the_prepared_module() -> None:
    with pytest.raises(TypeError) as err:
        _rig().no_backward_sync(_mlp())
    assert str(err.value) == (
        "no_backward_sync() needs the module that rig.prepare() returned (or torch.compile of it); got a "
        "Sequential that was not prepared: pass model, where model, optimizer = rig.prepare(model, optimizer)"
    )
    with pytest.raises(TypeError, match="got a OptimizedModule that was not prepared"):
        _rig().no_backward_sync(torch.compile(_mlp(), backend="eager"))


def test_a_compiled_prepared_module_counts_as_the_prepared_one() -> None:
    rig = _rig()
    model = rig.prepare(_mlp())
    compiled = torch.compile(model, backend="eager")
    with rig.no_backward_sync(compiled):  # a TypeError before
        rig.backward(compiled(torch.ones(2, 4)).sum())
    with pytest.raises(ValueError, match="OptimizedModule was already prepared by this Rig; prepare each object once"):
        rig.prepare(compiled)


def _with_grads(rig: torchrig.Rig) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rig.backward(model(torch.randn(8, 4) * 10).sum())
    return model, optimizer


def test_clip_gradients_by_norm() -> None:
    rig = _rig()
    model, optimizer = _with_grads(rig)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    total = rig.clip_gradients(model, optimizer, max_norm=0.5)
    assert isinstance(total, torch.Tensor)
    torch.testing.assert_close(total, expected)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)


def test_clip_gradients_by_value() -> None:
    rig = _rig()
    model, optimizer = _with_grads(rig)
    assert max(p.grad.abs().max().item() for p in model.parameters()) > 0.25
    assert rig.clip_gradients(model, optimizer, clip_val=0.25) is None
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.25


def test_clip_gradients_unscales_first_under_16_mixed() -> None:
    rig = _rig(precision="16-mixed")
    model = nn.Linear(4, 1, bias=False)  # a bias gradient equals the 65536 scale: inf in fp16
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rig.backward(model(torch.full((2, 4), 0.01)).mean())
    total = rig.clip_gradients(model, optimizer, max_norm=100.0)
    assert total is not None and total.item() < 1.0  # the true norm, not the 65536-scaled one
    optimizer.step()  # the GradScaler does not unscale a second time
    assert rig.precision.scaler is not None and rig.precision.scaler.get_scale() == 65536.0


def test_clip_gradients_needs_exactly_one_of_max_norm_and_clip_val() -> None:
    rig = _rig()
    model, optimizer = _with_grads(rig)
    with pytest.raises(ValueError, match=r"exactly one of max_norm= or clip_val= \(got max_norm=None, clip_val=None\)"):
        rig.clip_gradients(model, optimizer)
    with pytest.raises(ValueError, match=r"got max_norm=1.0, clip_val=1.0"):
        rig.clip_gradients(model, optimizer, max_norm=1.0, clip_val=1.0)


def test_init_module_creates_parameters_on_the_device_in_the_precision_dtype() -> None:
    rig = _rig(precision="64-true")
    with rig.init_module():
        model = _mlp()
    assert all(p.device == rig.device and p.dtype == torch.float64 for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32  # restored


def test_init_module_empty_init_goes_to_meta_and_prepare_materializes() -> None:
    rig = _rig()
    with rig.init_module(empty_init=True):
        model = _mlp()
    assert all(p.is_meta for p in model.parameters())
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.device == rig.device and torch.isfinite(p).all() for p in model.parameters())
    assert model.module[0].weight.abs().sum() > 0  # initialised by reset_parameters, not left empty
    before = model.module[0].weight.detach().clone()
    rig.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    assert not torch.equal(before, model.module[0].weight)


def test_to_device_and_seed_everything() -> None:
    rig = _rig()
    batch = {"x": [torch.ones(1)], "n": 1}
    assert rig.to_device(batch)["x"][0].device == rig.device
    assert rig.seed_everything(7) == 7
    a = torch.rand(3)
    rig.seed_everything(7)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(TypeError, match=r"seed='7' must be an int"):
        torchrig.seed_everything("7")  # type: ignore[arg-type]


def test_print_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    _rig().print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


def test_prepared_loader_yields_batches_and_loop_trains() -> None:
    rig = _rig()
    x_all = torch.randn(32, 4)
    data = TensorDataset(x_all, x_all.sum(dim=1, keepdim=True))
    model = _mlp()
    model, optimizer, loader = rig.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.05), DataLoader(data, batch_size=8, shuffle=True)
    )
    losses: list[torch.Tensor] = []
    for _ in range(6):
        for x, y in loader:
            assert x.device == rig.device
            loss = F.mse_loss(model(x), y)
            rig.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    assert torch.stack(losses[-4:]).mean() < 0.5 * torch.stack(losses[:4]).mean()


def test_optimizer_over_meta_parameters_prepared_without_its_module_is_an_error() -> None:
    rig = _rig()
    with rig.init_module(empty_init=True):
        model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rig.prepare(model)
    with pytest.raises(ValueError, match=r"holds parameters on the meta device .* rig.prepare\(model, optimizer\)"):
        rig.prepare(optimizer)


def test_empty_init_on_one_device_initialises_modules_with_private_reset() -> None:
    # nn.MultiheadAttention initialises itself in _reset_parameters(); materialising from meta
    # must call it, or the weights would be uninitialised memory.
    rig = torchrig.Rig(accelerator="cpu")
    with rig.init_module(empty_init=True):
        attention = nn.MultiheadAttention(4, 2)
    assert attention.in_proj_weight.is_meta
    prepared = rig.prepare(attention)
    weight = prepared.module.in_proj_weight
    assert not weight.is_meta and torch.isfinite(weight).all() and weight.abs().sum() > 0


def _no_script_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like a notebook or ``python -c``: no script file to run again."""
    import __main__

    monkeypatch.setattr(sys, "argv", [""])
    monkeypatch.delattr(__main__, "__file__", raising=False)
    monkeypatch.setattr(__main__, "__spec__", None, raising=False)


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP in one process warns about it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_of_a_parallel_strategy_runs_without_a_script_file(
    monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """One process starts no other: a notebook (or a pytest-xdist worker) may use ddp/fsdp on one device."""
    _no_script_file(monkeypatch)
    rig = torchrig.Rig(accelerator="cpu", devices=1, strategy=strategy)
    assert (rig.strategy.name, rig.world_size) == (strategy, 1)
    model = rig.prepare(nn.Linear(4, 1))
    rig.backward(model(torch.randn(2, 4)).sum())


@pytest.mark.timeout(60)
def test_more_processes_without_a_script_file_say_what_to_do_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_script_file(monkeypatch)
    with pytest.raises(
        ValueError, match=r"^strategy='ddp' starts the other processes by running this script again"
    ) as e:
        torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
    assert "'ddp_notebook' (fork) or 'ddp_spawn' with rig.launch(fn)" in str(e.value)
    assert "`torchrig run --devices N script.py`" in str(e.value)


def test_prepare_of_none_and_backward_of_a_non_tensor_say_what_they_got() -> None:
    """prepare(None) said 'NoneType was already prepared by this Rig'; backward(5) raised an AttributeError."""
    rig = torchrig.Rig(accelerator="cpu")
    with pytest.raises(TypeError, match=r"^prepare\(\) got a builtins.NoneType; it takes nn.Module, "):
        rig.prepare(None)
    with pytest.raises(TypeError, match=r"^rig.backward\(loss\) takes the loss tensor; got float$"):
        rig.backward(0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["-c", "-"], ids=["python -c", "python - (stdin)"])
def test_ddp_without_a_script_file_says_so_before_starting_a_rank(how: str) -> None:
    """From stdin it ran `python /cwd/-` as rank 1, which failed with "can't open file '-'"."""
    import subprocess

    from conftest import python_env

    code = (
        "import torch, torchrig\nrig = torchrig.Rig(accelerator='cpu', devices=2)\nrig.prepare(torch.nn.Linear(2, 2))\n"
    )
    argv, stdin = ([sys.executable, "-c", code], None) if how == "-c" else ([sys.executable, "-"], code)
    done = subprocess.run(argv, input=stdin, env=python_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 1
    assert (
        "this process was not started from a script file (an interactive session, a notebook, python -c, or a "
        "script read from stdin, python -)" in done.stderr
    ), done.stderr
    assert "rank 1" not in done.stderr and "can't open file" not in done.stderr, done.stderr
