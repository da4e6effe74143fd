"""A tiny Hugging Face causal LM (built from a config, no download) trained with its own
``_tp_plan``: ``ModelParallelStrategy(tensor_parallel=N)`` with ``tp_plan=None``.

    python hf_tensor_parallel.py --out W.pt --devices 2 --tp 2 --model llama|qwen3 [--empty-init]

Rank 0 writes the full final weights to ``--out`` and the losses and the plan used to ``--out.json``.
Importable for the one-process reference (``train``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import torchrig
from torchrig.parallel import collect_tp_plan

STEPS = 3
VOCAB, SEQ, BATCH = 64, 8, 4


def build(name: str) -> torch.nn.Module:
    """A 2-layer model of 4 heads (2 key/value heads), weights from seed 0, lm_head untied."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes))
    if name == "qwen3":  # per-head q_norm/k_norm: "replicated_with_grad_allreduce"
        return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **sizes))
    raise ValueError(f"--model {name!r}: llama or qwen3")


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)


def train(rig: torchrig.Rig, name: str, empty_init: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``STEPS`` AdamW steps on the same batches; the full final weights (rank 0) and a report.
    ``empty_init``: the model is created on ``meta`` and initialised by ``prepare``."""
    with rig.init_module(empty_init=empty_init):
        model = build(name)
    plan = collect_tp_plan(model)
    model, optimizer = rig.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    inv_freq = model.module.model.rotary_emb.inv_freq.tolist()
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        rig.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    state = {k: v.detach().clone() for k, v in rig.strategy.module_state_dict(model).items()}
    report = {"losses": losses, "plan": plan, "local_numel": local, "world_size": rig.world_size, "inv_freq": inv_freq}
    return state, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--empty-init", action="store_true")
    args = parser.parse_args()
    strategy = torchrig.ModelParallelStrategy(tensor_parallel=args.tp, tp_plan=None)
    rig = torchrig.Rig(accelerator="cpu", devices=args.devices, strategy=strategy)
    state, report = train(rig, args.model, args.empty_init)
    from model_parallel import write_result  # the script next to this one

    write_result(rig, args.out, state, report)


if __name__ == "__main__":
    main()
