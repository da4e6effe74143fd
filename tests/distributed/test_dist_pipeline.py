"""Pipeline parallel (``ModelParallelStrategy(pipeline_parallel=...)``) on real gloo processes.

Every run trains, from the same initial weights on the same global batches, 3 AdamW steps clipped
by norm (``scripts/model_parallel.py``) and is compared with one process: the demo transformer
with 4 blocks and a tiny transformers ``LlamaForCausalLM`` of 4 decoder layers, under each
schedule; pipelines combined with FSDP2 and tensor parallel; checkpoints moved between layouts.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import load_script
from test_dist_model_parallel import assert_same_training, assert_same_weights, launch

pytestmark = pytest.mark.distributed

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]


@cache
def reference(llama: bool = False, accumulate: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and report of the same training (4 blocks) in this one process."""
    import torchrig

    rig = torchrig.Rig(accelerator="cpu")
    state, report = load_script("model_parallel").train(rig, layers=4, llama=llama, accumulate=accumulate)
    return {k: v.clone() for k, v in state.items()}, report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_stages_train_like_one_process(tmp_path: Path, schedule: str) -> None:
    # GPipe and 1F1B run one stage per rank; the interleaved and V schedules two (4 stages of one block)
    weights, report = launch(tmp_path / "w.pt", "--devices", "2", "--pp", "2", "--layers", "4", "--schedule", schedule)
    ref_weights, ref = reference()
    assert report["strategy"] == "ModelParallelStrategy" and report["world_size"] == 2
    assert report["loader_replicas"] == 1  # both stages read the same batches
    assert report["local_numel"] < ref["local_numel"] * 0.6  # rank 0 holds the embedding and half the blocks
    assert_same_training(report, ref)  # the loss from the last stage, the norm over both stages
    assert_same_weights(weights, ref_weights)  # gathered from both stages under the original names


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_llama_two_stages_train_like_one_process(tmp_path: Path, schedule: str) -> None:
    pytest.importorskip("transformers")
    args = ["--devices", "2", "--pp", "2", "--layers", "4", "--llama", "--schedule", schedule]
    weights, report = launch(tmp_path / "w.pt", *args)
    ref_weights, ref = reference(llama=True)
    assert report["local_numel"] < ref["local_numel"] * 0.6
    assert any(k.startswith("model.layers.3.") for k in weights) and "lm_head.weight" in weights
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


@pytest.mark.timeout(120)
def test_gradients_accumulate_over_two_schedule_steps(tmp_path: Path) -> None:
    # each optimizer step from two forward_backward calls on halves of the batch, each loss halved:
    # the second schedule step adds to the first one's gradients (none divided twice)
    weights, report = launch(tmp_path / "w.pt", "--devices", "2", "--pp", "2", "--layers", "4", "--accumulate")
    ref_weights, ref = reference(accumulate=True)
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


@pytest.fixture(scope="module")
def pp_fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    """pp=2 x dp_shard=2 on 4 processes; its final checkpoint is saved for the layout tests."""
    folder = tmp_path_factory.mktemp("pp_fsdp")
    args = ["--devices", "4", "--pp", "2", "--shard", "2", "--layers", "4", "--save", str(folder / "ck")]
    weights, report = launch(folder / "w.pt", *args)
    return folder / "ck", weights, report


@pytest.mark.timeout(120)
def test_pipeline_times_fsdp_four_processes_train_like_one(pp_fsdp: Any) -> None:
    _, weights, report = pp_fsdp
    ref_weights, ref = reference()
    assert report["world_size"] == 4 and report["fsdp"] and report["loader_replicas"] == 2
    assert report["local_numel"] < ref["local_numel"] * 0.3  # half the model, sharded 2 ways
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


@pytest.mark.timeout(120)
def test_pipeline_times_tensor_parallel_four_processes_train_like_one(tmp_path: Path) -> None:
    weights, report = launch(tmp_path / "w.pt", "--devices", "4", "--pp", "2", "--tp", "2", "--layers", "4")
    ref_weights, ref = reference()
    assert report["world_size"] == 4 and not report["fsdp"] and report["loader_replicas"] == 1
    assert report["local_numel"] < ref["local_numel"] * 0.35
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


def test_pipeline_checkpoint_loads_into_one_process_and_consolidates(pp_fsdp: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    import torchrig
    from torchrig.cli import main

    script = load_script("model_parallel")
    ckpt, weights, _ = pp_fsdp
    # pp=2 x dp_shard=2 -> one process: every stage's tensors under the unsplit model's names
    rig = torchrig.Rig(accelerator="cpu")
    model = rig.prepare(script.make_model(4))
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = rig.prepare(DataLoader(script.dataset(), batch_size=script.GLOBAL_BATCH))
    fresh = rig.prepare(DataLoader(script.dataset(), batch_size=script.GLOBAL_BATCH))
    rig.load(ckpt, {"model": model, "optimizer": optimizer, "data": loader})
    assert_same_weights(rig.strategy.module_state_dict(model), weights, atol=0)
    assert torch.equal(next(iter(loader))[0], list(fresh)[3][0])  # the 4th global batch comes next
    # consolidate: one safetensors file with the full weights
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "consolidate", str(ckpt), str(out)]) == 0
    assert_same_weights({k.removeprefix("model."): v for k, v in load_file(out).items()}, weights, atol=0)


@pytest.mark.timeout(120)
def test_pipeline_checkpoint_loads_into_another_split(pp_fsdp: Any, tmp_path: Path) -> None:
    ckpt, weights, _ = pp_fsdp
    # saved as 2 + 2 blocks over pp=2 x dp_shard=2, loaded as 3 + 1 blocks on 2 processes
    args = ["--devices", "2", "--pp", "2", "--split", "layers.3", "--steps", "0", "--layers", "4"]
    resplit, report = launch(tmp_path / "s.pt", *args, "--load", str(ckpt))
    assert_same_weights(resplit, weights, atol=0)
    assert report["samples_seen"] == 3 * load_script("model_parallel").GLOBAL_BATCH


@pytest.mark.timeout(180)
def test_pipeline_checkpoint_through_fsdp_and_back(pp_fsdp: Any, tmp_path: Path) -> None:
    ckpt, weights, _ = pp_fsdp
    common = ["--steps", "0", "--layers", "4"]
    fsdp_args = ["--devices", "4", "--strategy", "fsdp", *common, "--load", str(ckpt), "--save", str(tmp_path / "f")]
    fsdp, _ = launch(tmp_path / "f.pt", *fsdp_args)
    assert_same_weights(fsdp, weights, atol=0)
    # FSDP over 4 -> pp=2 split 1 + 3 blocks
    back_args = ["--devices", "2", "--pp", "2", "--split", "layers.1", *common, "--load", str(tmp_path / "f")]
    back, report = launch(tmp_path / "b.pt", *back_args)
    assert_same_weights(back, weights, atol=0)
    assert report["samples_seen"] == 3 * load_script("model_parallel").GLOBAL_BATCH
