"""precision="fp8-mixed" (issue 18): torchao float8 training of chosen nn.Linear layers under bf16 autocast."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch import nn

import torchrig
from torchrig import fp8 as fp8_mod
from torchrig.precision import Precision, normalize_precision, supported_precisions

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(
    not HAS_TORCHAO, reason="torchao is not installed (the fp8 extra: pip install -e '.[fp8]')"
)


def _cpu_reason() -> str | None:
    return fp8_mod.fp8_unsupported_reason("cpu") if HAS_TORCHAO else "torchao is not installed"


needs_cpu_fp8 = pytest.mark.skipif(
    _cpu_reason() is not None, reason=f"torchao float8 training does not run on this CPU: {_cpu_reason()}"
)


def _float8_linear() -> type[nn.Module]:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 32, blocks: int = 2, inputs: int = 8, outputs: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(blocks)])
        self.head = nn.Linear(dim, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _kinds(module: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in module.named_modules() if isinstance(m, nn.Linear)}


# -- names and errors without torchao -------------------------------------------------------
def test_the_name_and_the_spec_normalize_to_fp8_mixed() -> None:
    assert normalize_precision("fp8-mixed") == "fp8-mixed"
    assert normalize_precision(torchrig.FP8Mixed()) == "fp8-mixed"
    with pytest.raises(ValueError, match=r"unknown precision='fp8'; choose from .*bf16-true, fp8-mixed or 'auto'"):
        normalize_precision("fp8")
    with pytest.raises(TypeError, match=r"FP8Mixed\(module_filter_fn='fc'\) must be a function \(module, fqn\)"):
        torchrig.FP8Mixed(module_filter_fn="fc")  # type: ignore[arg-type]


def test_missing_torchao_is_an_error_that_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now fails, as when it is not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ModuleNotFoundError) as info:
        torchrig.Rig(accelerator="cpu", precision="fp8-mixed")
    assert str(info.value).startswith(
        "precision='fp8-mixed' needs torchao's float8 training (torchao.float8), which cannot be imported ("
    )
    assert str(info.value).endswith(
        "install it with `pip install 'torchrig[fp8]'` (in a clone of torchrig: `pip install -e '.[fp8]'`), "
        "or use precision='bf16-mixed'"
    )
    assert info.value.name == "torchao"


def test_a_device_without_bf16_autocast_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"precision='fp8-mixed' runs under bf16 autocast \(bf16-mixed\), which is not supported on meta; "
        r"meta supports: 32-true",
    ):
        Precision(name="fp8-mixed", device_type="meta")


def test_cuda_below_capability_8_9_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert fp8_mod.fp8_unsupported_reason("cuda") == (
        "NVIDIA A100-SXM4-80GB has CUDA compute capability 8.0; float8 matmul needs 8.9 or newer "
        "(Ada Lovelace, Hopper, Blackwell)"
    )


@needs_torchao
def test_a_device_without_float8_matmul_is_an_error_not_a_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_scaled_mm(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("\"_scaled_mm\" not implemented for 'CPU'")

    monkeypatch.setattr(torch, "_scaled_mm", no_scaled_mm)
    with pytest.raises(ValueError) as info:
        torchrig.Rig(accelerator="cpu", precision="fp8-mixed")
    text = str(info.value)
    assert text.startswith(
        "precision='fp8-mixed' is not supported on cpu: torch._scaled_mm does not run on cpu "
        "(torch.float8_e4m3fn: RuntimeError: \"_scaled_mm\" not implemented for 'CPU'; "
    )
    assert text.endswith(f"). Use precision='bf16-mixed'; cpu supports: {', '.join(supported_precisions('cpu'))}")


# -- which layers are converted ---------------------------------------------------------------
@needs_cpu_fp8
def test_default_keeps_the_first_and_last_linear_and_converts_the_middle() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="fp8-mixed")
    model = Net()
    weights = {name: p for name, p in model.named_parameters()}
    prepared = rig.prepare(model)
    assert _kinds(model) == {
        "embed": "Linear",
        "blocks.0.fc1": "Float8Linear",
        "blocks.0.fc2": "Float8Linear",
        "blocks.1.fc1": "Float8Linear",
        "blocks.1.fc2": "Float8Linear",
        "head": "Linear",
    }
    assert type(model.embed) is nn.Linear and isinstance(model.blocks[0].fc1, _float8_linear())
    # The same parameter objects, fp32, under the same names: optimizers and checkpoints are those of bf16-mixed.
    assert dict(model.named_parameters()) == weights
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert prepared(torch.randn(4, 8)).dtype == torch.float32  # outputs are cast back, as under bf16-mixed
    plain = Net()
    plain.load_state_dict(model.state_dict())  # strict: the keys of the unconverted model
    assert torch.equal(plain.blocks[0].fc1.weight, model.blocks[0].fc1.weight)


@needs_cpu_fp8
def test_multihead_attention_out_proj_is_left_alone() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 32)
            self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
            self.mid = nn.Linear(32, 32)
            self.out = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.out(self.mid(self.attn(h, h, h)[0]))

    model = Attn()
    prepared = torchrig.Rig(accelerator="cpu", precision="fp8-mixed").prepare(model)
    # out_proj's forward never runs (attention reads its weight): converting it would compute nothing in float8.
    assert _kinds(model) == {
        "inp": "Linear",
        "attn.out_proj": "NonDynamicallyQuantizableLinear",
        "mid": "Float8Linear",
        "out": "Linear",
    }
    prepared(torch.randn(2, 16, 8)).sum().backward()


@needs_cpu_fp8
def test_the_trainer_takes_fp8_mixed() -> None:
    spec = torchrig.FP8Mixed(module_filter_fn=lambda module, fqn: fqn == "blocks.0.fc1")
    trainer = torchrig.Trainer(accelerator="cpu", precision=spec, logger=False, enable_progress_bar=False)
    assert trainer.rig.precision.name == "fp8-mixed" and trainer.rig.precision.fp8 is spec


@needs_cpu_fp8
def test_default_skips_layers_whose_sizes_are_not_multiples_of_16() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 24), nn.Linear(24, 32), nn.Linear(32, 32), nn.Linear(32, 3))
    torchrig.Rig(accelerator="cpu", precision="fp8-mixed").prepare(model)
    assert _kinds(model) == {"0": "Linear", "1": "Linear", "2": "Linear", "3": "Float8Linear", "4": "Linear"}


@needs_cpu_fp8
def test_a_module_filter_picks_the_layers() -> None:
    spec = torchrig.FP8Mixed(module_filter_fn=lambda module, fqn: fqn.endswith("fc1") or fqn == "embed")
    model = Net(inputs=16)
    torchrig.Rig(accelerator="cpu", precision=spec).prepare(model)
    assert _kinds(model) == {
        "embed": "Float8Linear",
        "blocks.0.fc1": "Float8Linear",
        "blocks.0.fc2": "Linear",
        "blocks.1.fc1": "Float8Linear",
        "blocks.1.fc2": "Linear",
        "head": "Linear",
    }


@needs_cpu_fp8
def test_a_filter_that_picks_a_layer_of_the_wrong_size_is_an_error() -> None:
    spec = torchrig.FP8Mixed(module_filter_fn=lambda module, fqn: fqn in ("embed", "head"))
    with pytest.raises(
        ValueError,
        match=r"precision='fp8-mixed': module_filter_fn chose embed: Linear\(8, 32\), head: Linear\(32, 3\); "
        r"float8 matmul \(torch._scaled_mm\) needs in_features and out_features that are multiples of 16\. "
        r"Leave these layers out of module_filter_fn \(they then compute in bf16\)",
    ):
        torchrig.Rig(accelerator="cpu", precision=spec).prepare(Net())


@needs_cpu_fp8
def test_converting_nothing_is_an_error() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="fp8-mixed")
    with pytest.raises(
        ValueError,
        match=r"precision='fp8-mixed' converts no layer of Sequential to float8: by default the first and the last "
        r"nn.Linear stay in bf16, .* its nn.Linear layers are 0: Linear\(32, 32\), 2: Linear\(32, 32\)\. "
        r"Choose layers with torchrig.FP8Mixed\(module_filter_fn=...\); use precision='bf16-mixed' for this model",
    ):
        rig.prepare(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)))
    with pytest.raises(ValueError, match=r"converts no layer of Conv1d to float8: it has no nn.Linear; use"):
        rig.prepare(nn.Conv1d(16, 16, 3))
    none = torchrig.FP8Mixed(module_filter_fn=lambda module, fqn: False)
    with pytest.raises(ValueError, match=r"module_filter_fn returned False for all its nn.Linear layers"):
        torchrig.Rig(accelerator="cpu", precision=none).prepare(Net())


# -- training ----------------------------------------------------------------------------------
def _train(precision: object, steps: int = 25, **rig_kwargs: object) -> tuple[list[float], nn.Module]:
    torch.manual_seed(0)
    model = Net(dim=32, blocks=2, inputs=16, outputs=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rig = torchrig.Rig(accelerator="cpu", precision=precision, **rig_kwargs)  # type: ignore[arg-type]
    prepared, optimizer = rig.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = x[:, :4].tanh() + 0.3 * torch.randn(256, 4, generator=g)  # noise: the loss stays above 0.09
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(prepared(x), y)
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return [float(v) for v in losses], model


@pytest.mark.slow  # two trainings: 5.1 s of CPU (measured on the shared 2-core machine)
@needs_cpu_fp8
def test_training_follows_bf16_mixed_within_tolerance() -> None:
    bf16, _ = _train("bf16-mixed")
    fp8, model = _train("fp8-mixed")
    assert sum(isinstance(m, _float8_linear()) for m in model.modules()) == 4
    assert fp8 != bf16  # the float8 layers did compute: not bf16-mixed under another name
    assert fp8[-1] < 0.2 * fp8[0]  # it trains
    # Measured: fp8 within 1.3% of bf16 at every step (bf16 within 0.1% of fp32).
    for step, (a, b) in enumerate(zip(fp8, bf16, strict=True)):
        assert abs(a - b) <= 0.05 * b, f"step {step}: fp8-mixed loss {a:.5f}, bf16-mixed {b:.5f}"


@needs_cpu_fp8
def test_conversion_comes_before_activation_checkpointing_and_compile() -> None:
    # The blocks are checkpointed and compiled with their float8 layers inside; the losses are those of eager fp8.
    eager, _ = _train("fp8-mixed", steps=3)
    both, model = _train(
        "fp8-mixed", steps=3, activation_checkpointing="full", compile={"regional": True, "backend": "eager"}
    )
    assert isinstance(model.blocks[1].fc2, _float8_linear())
    assert "forward" in model.blocks[0].__dict__  # checkpointed
    assert both == pytest.approx(eager, rel=1e-6)


@needs_cpu_fp8
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inductor_compiles_the_float8_layers() -> None:
    eager, _ = _train("fp8-mixed", steps=3)
    compiled, model = _train("fp8-mixed", steps=3, compile=True)
    assert isinstance(model.blocks[0].fc1, _float8_linear())
    # inductor fuses the scaling and casting: not bitwise, measured within 0.1% of eager.
    assert compiled == pytest.approx(eager, rel=1e-2)


@needs_cpu_fp8
def test_meta_init_then_fp8() -> None:
    rig = torchrig.Rig(accelerator="cpu", precision="fp8-mixed")
    with rig.init_module(empty_init=True):
        model = Net()
    prepared = rig.prepare(model)
    assert _kinds(model)["blocks.0.fc1"] == "Float8Linear"
    assert not any(p.is_meta for p in model.parameters())
    out = prepared(torch.randn(4, 8))
    out.sum().backward()
    assert model.blocks[0].fc1.weight.grad is not None and torch.isfinite(model.blocks[0].fc1.weight.grad).all()


@needs_cpu_fp8
def test_an_accelerator_can_carry_fp8_mixed() -> None:
    spec = torchrig.FP8Mixed(module_filter_fn=lambda module, fqn: fqn == "blocks.0.fc1")
    rig = torchrig.Rig(accelerator=torchrig.CPUAccelerator(precision=spec))
    assert rig.precision.name == "fp8-mixed" and rig.precision.fp8 is spec
    assert torchrig.Rig(accelerator=torchrig.CPUAccelerator(precision=spec), precision=spec).precision.fp8 is spec
    # The bare name means the default layers: another choice than this filter's.
    with pytest.raises(ValueError, match=r"precision=FP8Mixed\(module_filter_fn=.* carries precision='fp8-mixed'"):
        torchrig.Rig(accelerator=torchrig.CPUAccelerator(precision="fp8-mixed"), precision=spec)
    with pytest.raises(ValueError, match=r"precision='bf16-mixed' was given, but the accelerator 'cpu' carries"):
        torchrig.Rig(accelerator=torchrig.CPUAccelerator(precision=spec), precision="bf16-mixed")


@pytest.mark.slow  # a new interpreter importing torch and torchao: 3.5 s of CPU (measured on the shared 2-core machine)
@needs_torchao
@pytest.mark.timeout(120)
def test_fp8_on_the_cpu_prints_none_of_torchaos_expected_import_noise() -> None:
    import subprocess

    from conftest import PYTHON, python_env

    code = "import torchrig; torchrig.Rig(accelerator='cpu', precision='fp8-mixed'); print('built')"
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout == "built\n", proc.stderr
    # torchao 0.18 logged "Failed to load .../torchao/_C_mxfp8...so" and torch's Enum deprecation here
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr


def test_only_the_expected_import_messages_are_dropped() -> None:
    import logging
    import os

    def kept(text: str) -> bool:
        record = logging.LogRecord("torchao", logging.WARNING, __file__, 1, text, None, None)
        return fp8_mod._ExpectedImportNoise().filter(record)

    assert not kept(f"Failed to load {os.sep}site-packages{os.sep}torchao{os.sep}_C_mxfp8.so: Could not load")
    assert not kept("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile")
    assert kept(f"Failed to load {os.sep}elsewhere{os.sep}mine.so: missing")  # not torchao's own kernels
    assert kept("Skipping import of cpp extensions due to incompatible torch version")
