"""Hugging Face models split by their own ``_tp_plan`` (``tp_plan=None``) on real gloo processes.

Tiny ``LlamaForCausalLM`` and ``Qwen3ForCausalLM`` built from configs (no download) train 3 AdamW
steps on 2 tensor-parallel processes and must match the same training in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_helpers import SCRIPTS, explain, load_script, run

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_a_hugging_face_model_split_by_its_own_plan_trains_like_one_process(tmp_path: Path, model: str) -> None:
    import torchrig

    out = tmp_path / "w.pt"
    proc = run([str(SCRIPTS / "hf_tensor_parallel.py"), "--out", str(out), "--model", model], timeout=140)
    assert proc.returncode == 0, explain(proc)
    got, report = torch.load(out), json.loads(Path(f"{out}.json").read_text())
    want, ref = load_script("hf_tensor_parallel").train(torchrig.Rig(accelerator="cpu"), model)
    # the model's own plan, with transformers' style names, was used: the split layers hold half their weights
    assert report["plan"]["lm_head"] == "colwise_gather_output"
    assert report["plan"]["model.embed_tokens"] == "embedding_rowwise"
    if model == "qwen3":  # per-head norms between the split projections: their gradients are summed
        assert report["plan"]["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert report["world_size"] == 2 and report["local_numel"] < 0.6 * ref["local_numel"]
    assert report["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, atol=2e-4, rtol=1e-4), (key, (got[key] - value).abs().max())
    norm = "model.layers.0.self_attn.q_norm.weight" if model == "qwen3" else "model.norm.weight"
    assert not torch.allclose(want[norm], torch.ones_like(want[norm]), atol=1e-3)  # the norm trained too


@pytest.mark.timeout(150)
def test_a_hugging_face_model_made_on_meta_is_initialised_by_its_own_init_under_tensor_parallel(
    tmp_path: Path,
) -> None:
    # rig.init_module(empty_init=True), then prepare: each rank's shards and the rotary buffers
    # are initialised by the model's init_weights (inv_freq was uninitialised memory before)
    out = tmp_path / "w.pt"
    proc = run([str(SCRIPTS / "hf_tensor_parallel.py"), "--out", str(out), "--empty-init"], timeout=140)
    assert proc.returncode == 0, explain(proc)
    report = json.loads(Path(f"{out}.json").read_text())
    assert report["inv_freq"] == pytest.approx([1.0, 0.1, 0.01, 0.001])
    assert "non-persistent buffers" not in proc.stderr and "no reset_parameters" not in proc.stderr
    # weights of std 0.02 over 64 tokens: the first loss is close to log(64)
    assert report["losses"][0] == pytest.approx(4.16, abs=0.05)
    weights = torch.load(out)
    assert torch.equal(weights["model.norm.weight"].isfinite(), torch.ones(32, dtype=torch.bool))
    assert 0.01 < float(weights["model.layers.0.mlp.up_proj.weight"].std()) < 0.05  # std 0.02, 3 AdamW steps of 1e-2
