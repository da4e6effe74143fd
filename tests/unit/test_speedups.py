"""compile= and activation_checkpointing= (issue 18): arguments, numerics, state-dict keys."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import torchrig
from torchrig.speedups import repeated_blocks

SCRIPT = Path(__file__).resolve().parents[1] / "distributed" / "scripts" / "speedups.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchrig_test_speedups_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo imports the module of the code it traces
    spec.loader.exec_module(module)
    return module


S = _script()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# -- arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compile": "fast"}, "compile='fast'; use None (off), True (the whole model), 'regional'"),
        (
            {"compile": {"mod": "max-autotune"}},
            "compile={'mod': 'max-autotune'}: 'mod' is not an argument of torch.compile (it takes",
        ),
        ({"compile": {"regional": "yes"}}, "compile={'regional': 'yes'}: 'regional' must be True or False, got 'yes'"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing='some'; use None, a set of nn.Module"),
        (
            {"activation_checkpointing": ("selective", 0)},
            "activation_checkpointing=('selective', 0): n=0 must be an int >= 1 (every n-th repeated block is "
            "checkpointed)",
        ),
        ({"activation_checkpointing": {int}}, "activation_checkpointing={<class 'int'>}; use None"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        torchrig.Rig(accelerator="cpu", **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        torchrig.Trainer(accelerator="cpu", logger=False, **kwargs)


def test_a_model_without_repeated_blocks_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"compile: Sequential has no repeated blocks .*; use compile=True"):
        torchrig.Rig(accelerator="cpu", compile="regional").prepare(model)
    with pytest.raises(ValueError, match=r"activation_checkpointing: Sequential has no repeated blocks"):
        torchrig.Rig(accelerator="cpu", activation_checkpointing="full").prepare(model)
    with pytest.raises(ValueError, match="activation_checkpointing: Sequential has no submodule of class Block"):
        torchrig.Rig(accelerator="cpu", activation_checkpointing={S.Block}).prepare(model)
    with pytest.raises(ValueError, match="TinyTransformer is the model given to prepare"):
        torchrig.Rig(accelerator="cpu", activation_checkpointing={S.TinyTransformer}).prepare(S.TinyTransformer())


def test_repeated_blocks_are_the_one_class_children_of_a_list() -> None:
    model = S.TinyTransformer(blocks=3)
    assert repeated_blocks(model) == list(model.blocks)  # not the MLP's Sequential inside each block


# -- activation checkpointing --------------------------------------------------------------
def _grads_and_saved_bytes(ac: Any) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    torch.manual_seed(0)
    model = S.TinyTransformer(blocks=4)
    keys = list(model.state_dict())
    prepared = torchrig.Rig(accelerator="cpu", activation_checkpointing=ac).prepare(model)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = S.loss_of(prepared, S.batches(1)[0])
    loss.backward()
    assert list(prepared.state_dict()) == keys  # checkpointing changes no key
    return {n: p.grad.clone() for n, p in model.named_parameters()}, saved, keys


@pytest.mark.parametrize("ac", ["full", "selective", ("selective", 3), {"Block"}])
def test_activation_checkpointing_keeps_the_gradients_and_saves_less(ac: Any) -> None:
    ac = {S.Block} if ac == {"Block"} else ac
    plain, plain_bytes, _ = _grads_and_saved_bytes(None)
    grads, saved, _ = _grads_and_saved_bytes(ac)
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert saved < plain_bytes
    if ac == "full":
        assert saved < plain_bytes * 0.5, (saved, plain_bytes)


def test_selective_checkpoints_every_nth_block() -> None:
    def checkpointed(ac: Any) -> list[int]:
        model = S.TinyTransformer(blocks=5)
        torchrig.Rig(accelerator="cpu", activation_checkpointing=ac).prepare(model)
        return [i for i, b in enumerate(model.blocks) if "forward" in b.__dict__]

    assert checkpointed("full") == [0, 1, 2, 3, 4]
    assert checkpointed("selective") == [0, 2, 4]
    assert checkpointed(("selective", 3)) == [0, 3]
    assert checkpointed(["selective", 3]) == [0, 3]  # as a YAML/CLI list


# -- checkpoints do not depend on compilation -----------------------------------------------
def _model(how: str) -> tuple[nn.Module, nn.Module]:
    """A TinyTransformer (the object to save/load) and its weights' owner, made ``how``."""
    model = S.TinyTransformer()
    if how == "plain":
        return torchrig.Rig(accelerator="cpu").prepare(model), model
    if how == "rig_compiled":
        return torchrig.Rig(accelerator="cpu", compile=True).prepare(model), model
    if how == "rig_regional":
        return torchrig.Rig(accelerator="cpu", compile="regional").prepare(model), model
    if how == "user_compiled":  # torch.compile before prepare
        return torchrig.Rig(accelerator="cpu").prepare(torch.compile(model)), model
    assert how == "user_compiled_unprepared"
    return torch.compile(model), model


HOWS = ["plain", "rig_compiled", "rig_regional", "user_compiled", "user_compiled_unprepared"]


@pytest.mark.parametrize("saved_as", HOWS)
def test_checkpoints_load_across_compiled_and_plain(tmp_path: Path, saved_as: str) -> None:
    # Compilation is traced at the first call; the keys are what is compared here (the numerics
    # of compiled models are in the slow tests below).
    rig = torchrig.Rig(accelerator="cpu")
    torch.manual_seed(1)
    source, weights = _model(saved_as)
    rig.save(tmp_path / "ckpt", {"model": source})
    expected = {k: v.clone() for k, v in weights.state_dict().items()}
    for load_as in HOWS:
        torch.manual_seed(2)
        target, target_weights = _model(load_as)
        rig.load(tmp_path / "ckpt", {"model": target})
        if load_as != "user_compiled_unprepared":  # torch's OptimizedModule itself says "_orig_mod."
            assert list(target.state_dict()) == list(expected), (saved_as, load_as)
        for key, value in target_weights.state_dict().items():
            torch.testing.assert_close(value, expected[key])


def test_a_model_compiled_before_prepare_with_compile_too_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the model was compiled before prepare\(\) \(torch.compile\) and the Rig"):
        torchrig.Rig(accelerator="cpu", compile=True).prepare(torch.compile(S.TinyTransformer()))


# -- compiled numerics (slow: each first compile takes seconds on a CPU) ---------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rig_loop_compiled_matches_eager() -> None:
    eager, eager_state = S.train(torchrig.Rig(accelerator="cpu"))
    torch._dynamo.reset()  # graphs cached by earlier tests would be reused, not counted
    before = _graphs()
    regional, regional_state = S.train(torchrig.Rig(accelerator="cpu", compile="regional"))
    assert _graphs() == before + 1  # one graph, traced once, shared by both blocks
    whole, whole_state = S.train(torchrig.Rig(accelerator="cpu", compile=True, activation_checkpointing="full"))
    assert _graphs() > before + 1
    torch.testing.assert_close(regional, eager, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(whole, eager, rtol=1e-4, atol=1e-5)
    for key, value in eager_state.items():
        torch.testing.assert_close(regional_state[key], value, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(whole_state[key], value, rtol=1e-4, atol=1e-5)


class _LM(torchrig.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = S.TinyTransformer()
        self.losses: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = S.loss_of(self, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_compiled_matches_eager(tmp_path: Path) -> None:
    def fit(compile: Any) -> _LM:
        module = _LM()
        trainer = torchrig.Trainer(
            accelerator="cpu",
            compile=compile,
            max_steps=S.STEPS,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, torch.utils.data.DataLoader(torch.cat(S.batches()), batch_size=S.BATCH))
        return module

    eager = fit(None)
    torch._dynamo.reset()  # graphs cached by earlier tests would be reused, not counted
    before = _graphs()
    regional = fit("regional")
    assert _graphs() == before + 1  # the block traced once
    whole = fit(True)
    assert _graphs() > before + 1
    for compiled in (regional, whole):
        torch.testing.assert_close(torch.stack(compiled.losses), torch.stack(eager.losses), rtol=1e-4, atol=1e-5)
        for key, value in eager.state_dict().items():
            torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-4, atol=1e-5)


def test_the_cli_passes_both_switches_to_the_trainer(tmp_path: Path) -> None:
    from torchrig.cli import CLI
    from torchrig.speedups import ActivationCheckpointing, Compile

    args = ["--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = CLI(_LM, run=False, args=[*args, "--trainer.compile=regional", "--trainer.activation_checkpointing=full"])
    assert cli.trainer.rig._compile == Compile(regional=True)
    assert cli.trainer.rig._activation_checkpointing == ActivationCheckpointing(every=1)
    options = [
        "--trainer.compile={mode: max-autotune, regional: true}",
        "--trainer.activation_checkpointing=[selective, 3]",
    ]
    cli = CLI(_LM, run=False, args=[*args, *options])
    assert cli.trainer.rig._compile == Compile(regional=True, kwargs={"mode": "max-autotune"})
    assert cli.trainer.rig._activation_checkpointing == ActivationCheckpointing(every=3)


def test_checkpointing_a_model_created_on_meta() -> None:
    rig = torchrig.Rig(accelerator="cpu", activation_checkpointing="full")
    with rig.init_module(empty_init=True):
        model = S.TinyTransformer()
    keys = list(model.state_dict())
    prepared = rig.prepare(model)
    assert all("forward" in block.__dict__ for block in model.blocks)
    S.loss_of(prepared, S.batches(1)[0]).backward()
    assert list(prepared.state_dict()) == keys
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
