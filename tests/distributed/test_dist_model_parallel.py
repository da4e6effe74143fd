"""ModelParallelStrategy on real gloo processes: tensor parallel, FSDP2 x TP, HSDP, layouts of checkpoints.

Every run trains ``torchrig.demo.transformer.tiny`` (its ``_tp_plan`` splits attention and MLP
Megatron-style, the embedding by rows and the head by columns) for 3 AdamW steps clipped by norm,
from the same initial weights on the same global batches, and is compared with one process.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import SCRIPTS, explain, load_script, run

pytestmark = pytest.mark.distributed

SCRIPT = str(SCRIPTS / "model_parallel.py")


@cache
def reference() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and report of the same training in this one process."""
    import torchrig

    state, report = load_script("model_parallel").train(torchrig.Rig(accelerator="cpu"))
    return {k: v.clone() for k, v in state.items()}, report


def launch(out: Path, *args: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    proc = run([SCRIPT, "--out", str(out), *args], timeout=110)
    assert proc.returncode == 0, explain(proc)
    return torch.load(out), json.loads(Path(f"{out}.json").read_text())


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 2e-4) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        assert torch.allclose(got[key], value, atol=atol, rtol=1e-4), (key, (got[key] - value).abs().max())


def assert_same_training(report: dict[str, Any], ref: dict[str, Any]) -> None:
    assert torch.allclose(torch.tensor(report["losses"]), torch.tensor(ref["losses"]), atol=1e-5)
    # the norm before clipping, over DTensor shards on two meshes, equals the one of the whole model
    assert torch.allclose(torch.tensor(report["norms"]), torch.tensor(ref["norms"]), atol=1e-5)
    assert min(ref["norms"]) > load_script("model_parallel").MAX_NORM  # so every step clipped


@pytest.mark.timeout(120)
def test_tensor_parallel_two_processes_train_like_one(tmp_path: Path) -> None:
    weights, report = launch(tmp_path / "w.pt", "--devices", "2", "--tp", "2")
    ref_weights, ref = reference()
    assert report["strategy"] == "ModelParallelStrategy" and report["world_size"] == 2
    assert not report["fsdp"]  # one data-parallel rank: nothing to shard
    # the split layers hold half of their weights; norms stay whole
    assert report["local_numel"] < ref["local_numel"] * 0.6
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


@pytest.mark.timeout(120)
def test_sequence_parallel_trains_like_one_process(tmp_path: Path) -> None:
    # activations split along the sequence between the split matmuls: norms run on half the tokens
    weights, report = launch(tmp_path / "w.pt", "--devices", "2", "--tp", "2", "--sequence-parallel")
    ref_weights, ref = reference()
    assert report["local_numel"] < ref["local_numel"] * 0.6
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


@pytest.fixture(scope="module")
def two_d(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    """dp_shard=2 x tp=2 on 4 processes; its final checkpoint is saved for the layout tests."""
    folder = tmp_path_factory.mktemp("two_d")
    args = ["--devices", "4", "--shard", "2", "--tp", "2", "--save", str(folder / "ck")]
    weights, report = launch(folder / "w.pt", *args)
    return folder / "ck", weights, report


@pytest.mark.timeout(120)
def test_fsdp_times_tensor_parallel_four_processes_train_like_one(two_d: Any) -> None:
    _, weights, report = two_d
    ref_weights, ref = reference()
    assert report["world_size"] == 4 and report["fsdp"]
    assert report["local_numel"] < ref["local_numel"] * 0.3  # about a quarter (uneven splits round up)
    assert_same_training(report, ref)
    assert_same_weights(weights, ref_weights)


@pytest.mark.timeout(120)
def test_hsdp_matches_ddp(tmp_path: Path) -> None:
    # data_parallel_replicate=2 x dp_shard=2: each half of the ranks holds a sharded replica
    hsdp, report = launch(tmp_path / "h.pt", "--devices", "4", "--replicate", "2", "--shard", "2")
    ddp, ddp_report = launch(tmp_path / "d.pt", "--devices", "4", "--strategy", "ddp")
    assert report["fsdp"] and not ddp_report["fsdp"]
    assert ddp_report["local_numel"] * 0.45 < report["local_numel"] < ddp_report["local_numel"] * 0.55  # 2 ways
    assert_same_training(report, ddp_report)
    assert_same_weights(hsdp, ddp)
    assert_same_weights(hsdp, reference()[0])


@pytest.mark.timeout(120)
def test_checkpoint_moves_between_layouts(two_d: Any, tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    import torchrig
    from torchrig.demo.transformer import tiny

    script = load_script("model_parallel")
    ckpt, weights, report = two_d
    # 3 of the epoch's 4 global batches drawn by 2 data-parallel ranks (the 2 tensor-parallel
    # ranks of each share their batch): the position is in global samples
    assert (report["samples_seen"], report["loader_replicas"]) == (3 * script.GLOBAL_BATCH, 2)
    # (dp_shard=2, tp=2) -> one process: weights, optimizer and the place in the data
    rig = torchrig.Rig(accelerator="cpu")
    model = rig.prepare(tiny())
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = rig.prepare(DataLoader(script.dataset(), batch_size=script.GLOBAL_BATCH))
    fresh = rig.prepare(DataLoader(script.dataset(), batch_size=script.GLOBAL_BATCH))
    rig.load(ckpt, {"model": model, "optimizer": optimizer, "data": loader})
    assert_same_weights(rig.strategy.module_state_dict(model), weights, atol=0)
    assert torch.equal(next(iter(loader))[0], list(fresh)[3][0])  # the 4th global batch comes next
    # -> FSDP over 4 shards (loaded, then saved again without training) -> back to (dp_shard=2, tp=2)
    fsdp, fsdp_report = launch(
        tmp_path / "f.pt",
        "--devices",
        "4",
        "--strategy",
        "fsdp",
        "--steps",
        "0",
        "--load",
        str(ckpt),
        "--save",
        str(tmp_path / "fsdp_ck"),
    )
    assert_same_weights(fsdp, weights, atol=0)
    # Loaded and saved again before any batch: the position is saved as it was loaded (global samples,
    # with the layout that counted them), not rounded to this layout's batches
    assert (fsdp_report["samples_seen"], fsdp_report["loader_replicas"]) == (3 * script.GLOBAL_BATCH, 2)
    back, back_report = launch(
        tmp_path / "b.pt",
        "--devices",
        "4",
        "--shard",
        "2",
        "--tp",
        "2",
        "--steps",
        "0",
        "--load",
        str(tmp_path / "fsdp_ck"),
    )
    assert_same_weights(back, weights, atol=0)
    assert (back_report["samples_seen"], back_report["loader_replicas"]) == (3 * script.GLOBAL_BATCH, 2)
    # consolidate: one safetensors file with the full weights
    from safetensors.torch import load_file

    from torchrig.cli import main

    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "consolidate", str(ckpt), str(out)]) == 0
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert_same_weights({k.removeprefix("model."): v for k, v in load_file(out).items()}, weights, atol=0)


@pytest.mark.timeout(120)
def test_empty_init_under_tensor_parallel_materialises_shards(tmp_path: Path) -> None:
    weights, report = launch(tmp_path / "e.pt", "--devices", "2", "--tp", "2", "--empty-init")
    _, ref = reference()
    assert report["local_numel"] < ref["local_numel"] * 0.6 and report["finite"]
    assert sorted(weights) == sorted(reference()[0])
    # initialised by each module's reset_parameters(): an embedding ~ N(0, 1), LayerNorm weights 1
    assert 0.8 < float(weights["tok.weight"].std()) < 1.2
    assert torch.allclose(weights["norm.weight"], torch.ones(32), atol=0.1)  # 3 small steps away from 1


@pytest.mark.timeout(120)
def test_trainer_with_tensor_parallel_fits_like_one_process(tmp_path: Path) -> None:
    # The transformer sits inside a TrainingModule: its _tp_plan is found there ("net.layers.*...").
    out = tmp_path / "w.pt"
    proc = run([str(SCRIPTS / "model_parallel_fit.py"), str(tmp_path / "tp"), str(out)], timeout=110)
    assert proc.returncode == 0, explain(proc)
    sys.path.insert(0, str(SCRIPTS))  # model_parallel_fit imports the data of model_parallel
    ref, _ = load_script("model_parallel_fit").fit(str(tmp_path / "one"))
    assert_same_weights(torch.load(out), ref)
    meta = json.loads((tmp_path / "tp" / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["sharded"] is True and meta["entries"]["module"]["dcp"] is True  # the Trainer saved through DCP
