"""``rig.init_module(empty_init=True)``: buffers created on ``meta`` are initialised too (or named).

A Hugging Face Llama keeps its rotary frequencies in a non-persistent buffer (``inv_freq``): not in
the state dict, so loading the weights cannot repair it. Materialising the model must compute it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchrig

pytestmark = pytest.mark.timeout(60)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_a_hugging_face_model_made_on_meta_computes_its_rotary_buffers() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = _llama()
    rig = torchrig.Rig(accelerator="cpu")
    with rig.init_module(empty_init=True):
        empty = _llama()
    assert empty.model.rotary_emb.inv_freq.is_meta
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left uninitialised, so nothing to warn about
        model = rig.prepare(empty)
    rotary = model.module.model.rotary_emb
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)  # garbage before
    assert torch.equal(rotary.original_inv_freq, reference.model.rotary_emb.original_inv_freq)
    # initialised by the model's own init_weights: its std, its norms of ones
    assert 0.015 < float(model.module.model.layers[0].mlp.up_proj.weight.detach().std()) < 0.025
    assert torch.equal(model.module.model.norm.weight, torch.ones(32))
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


class Positions(nn.Module):
    """A buffer computed in ``__init__``, kept out of the state dict, and no way to recompute it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.arange(4.0), persistent=False)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.steps)


class Recomputed(Positions):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.steps.copy_(torch.arange(4.0))


def test_a_buffer_nothing_initialises_is_named_with_the_fix() -> None:
    rig = torchrig.Rig(accelerator="cpu")
    with rig.init_module(empty_init=True):
        model = nn.Sequential(Positions())
    with pytest.warns(UserWarning) as record:
        rig.prepare(model)
    assert [str(w.message) for w in record] == [
        "rig.init_module(empty_init=True): these non-persistent buffers were created on the meta device and nothing "
        "initialised them, so they hold uninitialised memory: 0.steps. Loading weights cannot repair them (a "
        "checkpoint does not hold them): give their module a reset_parameters() that computes them (or the model an "
        "init_weights()), or create the model without empty_init=True"
    ]


def test_a_buffer_its_module_recomputes_is_initialised_without_a_warning() -> None:
    rig = torchrig.Rig(accelerator="cpu")
    with rig.init_module(empty_init=True):
        model = nn.Sequential(Recomputed())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = rig.prepare(model)
    assert torch.equal(prepared.module[0].steps, torch.arange(4.0))
