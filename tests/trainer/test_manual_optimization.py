"""Manual optimization (``automatic_optimization = False``): the GAN example equals its Rig loop
(1 and 2 processes, 32-true and 16-mixed), the accessors, manual_backward, clip_gradients,
no_backward_sync, and the settings refused with it."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from trainer_helpers import ROOT, Regressor, loader, printed_json, quiet_trainer, subprocess_env

GAN_SCRIPT = ROOT / "examples" / "gan.py"


def load_gan_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gan_example", GAN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_all_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in got:
        assert torch.allclose(got[key], expected[key], atol=1e-6), (key, (got[key] - expected[key]).abs().max())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_gan_example_trains_the_weights_of_the_same_loop_written_with_the_rig(precision: str) -> None:
    gan = load_gan_example()
    torch.manual_seed(0)
    start = gan.GAN()
    with_trainer, with_rig = copy.deepcopy(start), copy.deepcopy(start)
    trainer = gan.train_with_trainer(with_trainer, devices=1, precision=precision, epochs=2, seed=1)
    rig = gan.train_with_rig(with_rig, devices=1, precision=precision, epochs=2, seed=1)
    assert_all_close(with_trainer.state_dict(), with_rig.state_dict())
    assert trainer.global_step == 2 * 16  # 512 samples in batches of 32: each batch is one step
    changed = [not torch.equal(a, b) for a, b in zip(with_trainer.parameters(), start.parameters(), strict=True)]
    assert all(changed)  # both networks trained
    if precision == "16-mixed":  # both loops went through the same scaler states
        assert trainer.rig.precision.scaler is not None and rig.precision.scaler is not None
        assert trainer.rig.precision.scaler.get_scale() == rig.precision.scaler.get_scale()


class ScaleProbe(Regressor):
    """Records the gradient manual_backward leaves, and the one a plain backward gives."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.recorded: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = 1e-3 * torch.nn.functional.mse_loss(self(x), y)  # small: x 2**16 stays finite in fp16
        weight = self.net[0].weight
        (plain,) = torch.autograd.grad(loss, weight, retain_graph=True)
        opt.zero_grad()
        self.manual_backward(loss)
        assert weight.grad is not None
        scale = self.trainer.rig.precision.scaler.get_scale()
        self.recorded.append((weight.grad.clone(), plain, scale))
        opt.step()


def test_manual_backward_scales_the_loss_under_16_mixed(tmp_path: Path) -> None:
    module = ScaleProbe()
    quiet_trainer(tmp_path, max_steps=2, precision="16-mixed").fit(module, loader(16, batch_size=4))
    for scaled, plain, scale in module.recorded:
        assert scale == 2.0**16
        assert torch.allclose(scaled / scale, plain, rtol=1e-2, atol=1e-4)
        assert scaled.abs().max() > 100 * plain.abs().max()  # not the plain gradient


class Manual(Regressor):
    """Manual optimization of the Regressor: one optimizer, optional accumulation and clipping."""

    def __init__(self, accumulate: int = 1, clip: float | None = None, schedulers: int = 0) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulate, self.clip, self.schedulers = accumulate, clip, schedulers
        self.norms: list[torch.Tensor | None] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        boundary = (batch_idx + 1) % self.accumulate == 0
        with self.no_backward_sync(enabled=not boundary):
            self.manual_backward(loss / self.accumulate)
        if boundary:
            self.norms.append(self.clip_gradients(opt, gradient_clip_val=self.clip))
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.schedulers:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1) for _ in range(self.schedulers)]


@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, None), (2, 0.5)])
def test_manual_accumulation_and_clipping_equal_the_automatic_trainer(
    tmp_path: Path, accumulate: int, clip: float | None
) -> None:
    torch.manual_seed(0)
    start = Regressor()
    automatic = copy.deepcopy(start)
    quiet_trainer(tmp_path, max_epochs=2, seed=3, accumulate_grad_batches=accumulate, gradient_clip_val=clip).fit(
        automatic, loader(32, batch_size=4, shuffle=True)
    )
    manual = Manual(accumulate, clip)
    manual.load_state_dict(start.state_dict())
    trainer = quiet_trainer(tmp_path, max_epochs=2, seed=3)
    trainer.fit(manual, loader(32, batch_size=4, shuffle=True))
    assert_all_close(manual.state_dict(), automatic.state_dict())
    assert trainer.global_step == 16  # every batch counts as a step under manual optimization
    norms = [n for n in manual.norms if n is not None]
    assert len(norms) == (16 // accumulate if clip is not None else 0)


def test_optimizers_and_lr_schedulers_are_the_prepared_objects(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    class Probe(Manual):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen["optimizers"], seen["schedulers"] = self.optimizers(), self.lr_schedulers()
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(Probe(), loader(8))
    assert seen["optimizers"] is trainer.optimizers[0] and isinstance(seen["optimizers"], torch.optim.SGD)
    assert seen["schedulers"] is None
    trainer = quiet_trainer(tmp_path, max_epochs=3)
    module = Probe(schedulers=1)
    trainer.fit(module, loader(8))
    assert seen["schedulers"] is trainer.lr_scheduler_configs[0].scheduler
    assert seen["schedulers"].last_epoch == 0  # manual optimization steps its own schedulers
    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(Probe(schedulers=2), loader(8))
    assert seen["schedulers"] == [cfg.scheduler for cfg in trainer.lr_scheduler_configs]

    class TwoOptimizers(Probe):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            seen["optimizers"] = self.optimizers()

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.Adam(self.net[3].parameters())]

    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(TwoOptimizers(), loader(8))
    assert seen["optimizers"] == trainer.optimizers and len(seen["optimizers"]) == 2


def test_manual_optimization_counts_batches_as_steps_and_stops_at_max_steps(tmp_path: Path) -> None:
    module = Manual()
    trainer = quiet_trainer(tmp_path, max_steps=3, max_epochs=5, log_every_n_steps=1)
    trainer.fit(module, loader(32, batch_size=4))
    assert trainer.global_step == 3 and trainer.fit_state.batch_idx == 0  # the epoch was ended
    assert "train_loss" in trainer.logged_metrics and trainer.run.logged["epoch"] == 0  # the last row sent


def test_manual_backward_under_automatic_optimization_is_refused(tmp_path: Path) -> None:
    class Wrong(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            return loss

    with pytest.raises(RuntimeError, match=r"Wrong.manual_backward\(\) is for manual optimization: set "):
        quiet_trainer(tmp_path, max_steps=1).fit(Wrong(), loader(8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accumulate_grad_batches": 2}, r"Trainer\(accumulate_grad_batches=2\) accumulates for the Trainer's own "),
        ({"gradient_clip_val": 1.0}, r"Trainer\(gradient_clip_val=1.0\) clips at the Trainer's own optimizer steps"),
    ],
)
def test_trainer_stepping_settings_are_refused_under_manual_optimization(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message + r".*Manual sets automatic_optimization = False"):
        quiet_trainer(tmp_path, max_steps=1, **kwargs).fit(Manual(), loader(8))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"gradient_clip_val": float("nan")}, ValueError, r"^gradient_clip_val=nan must be a finite number >= 0; "),
        ({"gradient_clip_val": "1"}, TypeError, r"^gradient_clip_val='1' must be a number, not str"),
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "l2"}, ValueError, r"^gradient_clip_algorithm='l2'; "),
    ],
)
def test_clip_gradients_refuses_bad_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type, message: str
) -> None:
    class Clipping(Manual):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.clip_gradients(self.optimizers(), **kwargs)
            return super().training_step(batch, batch_idx)

    with pytest.raises(error, match=message):
        quiet_trainer(tmp_path, max_steps=1).fit(Clipping(), loader(8))


def test_clip_gradients_by_value_bounds_every_element(tmp_path: Path) -> None:
    grads: list[torch.Tensor] = []

    class ByValue(Manual):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            self.manual_backward(100 * torch.nn.functional.mse_loss(self(x), y))
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="value")
            grads.extend(p.grad.clone() for p in self.parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad()

    quiet_trainer(tmp_path, max_steps=2).fit(ByValue(), loader(8))
    assert grads and max(float(g.abs().max()) for g in grads) == pytest.approx(0.01)


def test_no_backward_sync_outside_a_fit_says_so() -> None:
    with pytest.raises(RuntimeError, match="Manual is not attached to a Trainer"), Manual().no_backward_sync():
        pass


def test_direct_caller_runs_a_method_under_the_precision_but_not_as_the_forward() -> None:
    """RigModule.direct_caller (FSDP's manual step): autocast and output casts around the method, no
    forward hooks of the wrapped module around it; a device mismatch is explained as in forward."""
    import torchrig
    from torchrig.diagnostics import DeviceMismatchError

    rig = torchrig.Rig(accelerator="cpu", precision="bf16-mixed")
    model = rig.prepare(torch.nn.Linear(4, 2))
    forwards: list[str] = []
    model.module.register_forward_pre_hook(lambda *_: forwards.append("forward"))
    seen: list[bool] = []

    def method(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return model.module(x)

    out = model.direct_caller(method)(torch.randn(3, 4))
    assert seen == [True] and out.dtype == torch.float32  # computed in bf16, handed back in fp32
    assert forwards == ["forward"]  # only the call made inside the method
    with pytest.raises(DeviceMismatchError):
        model.direct_caller(lambda x: model.module(x.to("meta")))(torch.randn(3, 4))


def test_fsdp_manual_step_calling_a_submodule_inside_the_roots_shard_says_what_to_shard(tmp_path: Path) -> None:
    """Without auto_wrap_policy the GAN's generator is part of the root's shard: outside the root's
    forward its parameters are this rank's shards, and calling it directly cannot work."""
    gan = load_gan_example()
    trainer = quiet_trainer(tmp_path, strategy="fsdp", max_steps=1)
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(gan.GAN(), DataLoader(gan.make_data(64), batch_size=32))
    message = str(raised.value)
    assert message.startswith(
        "under manual optimization with strategy='fsdp', training_step runs outside the model's forward, where "
        "FSDP keeps only each rank's shard of the parameters: call self(...) (the sharded root), or submodules "
        "sharded on their own (FSDPStrategy(auto_wrap_policy={YourSubmodule, ...}))"
    ), message
    assert "torch said: " in message and "DTensor" in message


def test_fsdp_init_root_makes_the_root_before_a_submodule_runs_first() -> None:
    """fsdp._init_root reaches FSDP2's private lazy init (no public call does it): a manual step may
    call a sharded submodule before the root. Fails if torch renames or changes it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchrig.strategies.fsdp import _init_root

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # undone by conftest

    def sharded() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        reference = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (1,))  # fully_shard's default is the GPU's where there is one
        fully_shard(model[0], mesh=mesh)
        return fully_shard(model, mesh=mesh), reference

    x = torch.randn(2, 4)
    plain, _ = sharded()
    plain[0](x)  # the submodule runs first and makes itself a root
    with pytest.raises(RuntimeError, match="requires running forward through the root module first"):
        plain(x)
    model, reference = sharded()
    _init_root(model)
    assert torch.allclose(model[0](x), reference[0](x))
    assert torch.allclose(model(x), reference(x))  # the root still runs
    _init_root(torch.nn.Linear(2, 2))  # not sharded: nothing to do


def run_gan(tmp_path: Path, loop: str, devices: int, precision: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{loop}-{devices}.pt"
    args = ["--loop", loop, "--devices", str(devices), "--precision", precision, "--epochs", "2", "--save", out]
    done = subprocess.run(
        [sys.executable, str(GAN_SCRIPT), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{loop}: {devices} process(es), {precision}: generated mean (" in done.stdout
    return torch.load(out)  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_gan_example_on_two_processes_equals_its_rig_loop(tmp_path: Path, precision: str) -> None:
    trainer = run_gan(tmp_path, "trainer", 2, precision)
    assert_all_close(trainer, run_gan(tmp_path, "rig", 2, precision))


DDP_SCRIPT = r"""
import json, sys
import torch
import torchrig
from trainer_helpers import Regressor, loader
from test_manual_optimization import Manual

torch.manual_seed(0)
start = Regressor()
automatic = Regressor()
automatic.load_state_dict(start.state_dict())
common = dict(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, seed=3, enable_progress_bar=False,
              logger=False, enable_checkpointing=False, default_root_dir=sys.argv[1])
trainer = torchrig.Trainer(accumulate_grad_batches=2, **common)
trainer.fit(automatic, loader(32, batch_size=2, shuffle=True))


class Checked(Manual):
    # manual accumulation over 2 batches that notes whether the ranks' gradients differ after each backward

    def training_step(self, batch, batch_idx):
        opt, (x, y) = self.optimizers(), batch
        boundary = batch_idx % 2 == 1
        with self.no_backward_sync(enabled=not boundary):
            self.manual_backward(torch.nn.functional.mse_loss(self(x), y) / 2)
        grads = self.trainer.rig.all_gather(self.net[0].weight.grad)
        self.local.append(not torch.equal(grads[0], grads[1]))
        if boundary:
            opt.step()
            opt.zero_grad()


manual = Checked()
manual.local = []
manual.load_state_dict(start.state_dict())
trainer = torchrig.Trainer(**common)
trainer.fit(manual, loader(32, batch_size=2, shuffle=True))
flat = torch.cat([p.detach().flatten() for p in manual.parameters()])
gathered = trainer.rig.all_gather(flat)
expected = torch.cat([p.detach().flatten() for p in automatic.parameters()])
sys.stdout.write(json.dumps({  # one write: the ranks share the output
    "ranks": [trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size],
    "same_on_every_rank": bool(torch.equal(gathered[0], gathered[1])),
    "equals_automatic": bool(torch.allclose(flat, expected, atol=1e-6)),
    "steps": trainer.global_step,
    "local_grads": manual.local,
}) + "\n")
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_manual_accumulation_with_no_backward_sync_on_two_processes(tmp_path: Path) -> None:
    """DDP without find_unused_parameters: every backward reaches every parameter."""
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    env = subprocess_env()
    env["PYTHONPATH"] = f"{Path(__file__).parent}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=110, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted(printed_json(done.stdout), key=str)
    assert [r["ranks"] for r in rows] == [[0, 0, 0, 2], [1, 1, 0, 2]]
    assert all(r["same_on_every_rank"] and r["equals_automatic"] and r["steps"] == 16 for r in rows)
    # inside no_backward_sync each rank keeps its own gradients; the next backward averages them
    assert all(r["local_grads"] == [True, False] * 8 for r in rows)


NO_FIND_UNUSED = r"""
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("gan_example", sys.argv[1])
gan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gan)
gan.strategy_for = lambda devices: "ddp"  # without find_unused_parameters
torch.manual_seed(0)
gan.train_with_trainer(gan.GAN(), devices=2, precision="32-true", epochs=1, seed=1)
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_a_backward_that_misses_parameters_under_ddp_asks_for_find_unused_parameters(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(NO_FIND_UNUSED)
    done = subprocess.run(
        [sys.executable, str(script), str(GAN_SCRIPT)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert (
        "RuntimeError: an earlier backward in this training_step did not reach every parameter (a GAN's "
        "discriminator loss does not reach the generator), so DDP never finished averaging its gradients; "
        "pass strategy=torchrig.DDPStrategy(find_unused_parameters=True)" in done.stderr
    ), done.stderr[-3000:]


FSDP_SCRIPT = r"""
import importlib.util, json, sys
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
import torchrig
from trainer_helpers import Regressor, loader
from test_manual_optimization import Manual

spec = importlib.util.spec_from_file_location("gan_example", sys.argv[1])
gan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gan)


def fit(module, strategy, data):
    trainer = torchrig.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, seed=1,
                               enable_progress_bar=False, logger=False, enable_checkpointing=False,
                               num_sanity_val_steps=0, default_root_dir=sys.argv[2])
    trainer.fit(module, data)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in module.state_dict().items()}
    return trainer, {k: v.detach().clone() for k, v in full.items()}


def twins(make):
    torch.manual_seed(0)
    start = make()
    a, b = make(), make()
    a.load_state_dict(start.state_dict())
    b.load_state_dict(start.state_dict())
    return start.state_dict(), a, b


def largest(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# The GAN (two optimizers, two backward passes, clipping): the networks are the FSDP units.
start, on_ddp, on_fsdp = twins(gan.GAN)
data = lambda: DataLoader(gan.make_data(256), batch_size=32, shuffle=True)
_, ddp = fit(on_ddp, torchrig.DDPStrategy(find_unused_parameters=True), data())
trainer, fsdp = fit(on_fsdp, torchrig.FSDPStrategy(auto_wrap_policy={nn.Sequential}), data())
gan_row = {"fsdp_vs_ddp": largest(fsdp, ddp), "least_change": min(float((ddp[k] - start[k]).abs().max()) for k in ddp),
           "steps": trainer.global_step, "strategy": repr(trainer.rig.strategy)}

# self(x) on the root, accumulating over 2 batches with no_backward_sync, clipping at each step.
_, on_ddp, on_fsdp = twins(lambda: Manual(accumulate=2, clip=0.5))
_, ddp = fit(on_ddp, "ddp", loader(32, batch_size=2, shuffle=True))
trainer, fsdp = fit(on_fsdp, "fsdp", loader(32, batch_size=2, shuffle=True))
clipped = [float(n) for n in on_fsdp.norms]

# The same under tensor parallelism (ModelParallelStrategy, an FSDPStrategy): both ranks see each
# batch of 4, as the two DDP ranks see its halves (without shuffling, rank r takes samples r::2).
_, in_order, on_tp = twins(lambda: Manual(accumulate=2, clip=0.5))
_, ddp_in_order = fit(in_order, "ddp", loader(32, batch_size=2))
tp_plan = {"net.0": "colwise", "net.3": "rowwise"}
_, tp = fit(on_tp, torchrig.ModelParallelStrategy(tensor_parallel=2, tp_plan=tp_plan), loader(32, batch_size=4))
sys.stdout.write(json.dumps({  # one write: the ranks share the output
    "rank": trainer.global_rank, "gan": gan_row, "accumulated": largest(fsdp, ddp), "steps": trainer.global_step,
    "tensor_parallel": largest(tp, ddp_in_order),
    "tp_sharded": isinstance(on_tp.net[0].weight, DTensor),
    "norms": len(clipped),
    "norms_close": torch.allclose(torch.tensor(clipped), torch.tensor([float(n) for n in on_ddp.norms]), atol=1e-6),
}) + "\n")
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_manual_optimization_on_two_fsdp_processes_equals_ddp(tmp_path: Path) -> None:
    """FSDP2 runs a manual step like DDP: the same global data gives the same weights (allclose),
    for the GAN (two optimizers, each network its own FSDP unit) and for accumulation over
    no_backward_sync with clipping (the root's shard); so does tensor parallelism."""
    script = tmp_path / "run.py"
    script.write_text(FSDP_SCRIPT)
    env = subprocess_env()
    env["PYTHONPATH"] = f"{Path(__file__).parent}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, str(script), str(GAN_SCRIPT), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted(printed_json(done.stdout), key=str)
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        gan = row["gan"]
        assert gan["strategy"].startswith("FSDPStrategy(")
        assert gan["steps"] == 4  # 256 samples, batches of 32, 2 processes
        assert gan["least_change"] > 1e-4  # every weight of both networks trained
        assert gan["fsdp_vs_ddp"] < 1e-6, gan
        assert row["steps"] == 8 and row["accumulated"] < 1e-6, row
        assert row["norms"] == 4 and row["norms_close"]  # clip_gradients' total norm, one per optimizer step
        assert row["tp_sharded"] and row["tensor_parallel"] < 1e-6, row
