"""``torchrig.plan`` / ``torchrig plan``: every rank of a job planned in one process with a fake process group."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

import torchrig
from torchrig.cli import main
from torchrig.demo.transformer import tiny, transformer_1b


@pytest.mark.timeout(180)
def test_plan_of_a_1b_transformer_on_64_ranks() -> None:
    # the strategy applied in the fake group as ranks 0, 37 and 63; every other rank derived from their placements
    p = torchrig.plan(transformer_1b, world_size=64, tensor_parallel=8, applied_ranks=[0, 37, 63])
    assert p.mesh_sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 8}
    assert p.numel == 1_037_377_536
    assert [r.rank for r in p.ranks] == list(range(64))
    assert not dist.is_initialized()  # the fake group is gone
    assert len(p.groups()) == 1  # every dimension divides evenly: all ranks hold the same shapes
    rank = p.ranks[37]
    assert rank.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 4, "tp": 5}
    shards = {s.name: s for s in rank.params}
    q = shards["layers.3.attn.q.weight"]  # split by columns over tp=8, then by rows over dp_shard=8
    assert (q.shape, q.local_shape) == ((2048, 2048), (32, 2048))
    assert q.placements == "dp_shard:_S(0, 8), tp:S(0)"
    o = shards["layers.3.attn.o.weight"]  # split by rows (input features) over tp, dim 0 over dp_shard
    assert (o.local_shape, o.placements) == ((256, 256), "dp_shard:S(0), tp:S(1)")
    assert shards["norm.weight"].placements == "dp_shard:S(0)"  # replicated over tp, sharded by FSDP2
    # bf16-mixed keeps fp32 parameters, fp32 gradients and two fp32 AdamW moments
    held = sum(s.local_numel for s in rank.params)
    # norms and the row-split layers' biases stay whole over tp (18 layers x 5 x 2048, + the final norm's 2 x 2048):
    # FSDP2 splits them 8 ways; everything else is split 64 ways
    replicated = 18 * 5 * 2048 + 2 * 2048
    assert held == replicated // 8 + (p.numel - replicated) // 64 == 16_229_632
    assert (rank.param_bytes, rank.grad_bytes, rank.optimizer_bytes) == (4 * held, 4 * held, 8 * held)
    text = p.report(max_params=3)
    mesh = "mesh pp=1 x dp_replicate=1 x dp_shard=8 x tp=8"
    assert f"64 ranks, {mesh}, precision bf16-mixed, 1,037,377,536 parameters" in text
    assert "ranks 0-63: parameter shards" in text and "... 217 more" in text
    assert "  0-63               0.06 GiB   0.06 GiB   0.12 GiB   0.24 GiB" in text


@pytest.mark.parametrize(
    ("world", "kwargs"),
    [(6, {"tensor_parallel": 2}), (12, {"tensor_parallel": 2, "data_parallel_replicate": 2}), (5, {})],
)
def test_ranks_derived_from_one_equal_the_strategy_applied_on_each(world: int, kwargs: dict[str, int]) -> None:
    derived = torchrig.plan(tiny, world_size=world, **kwargs)
    applied = torchrig.plan(tiny, world_size=world, applied_ranks=range(world), **kwargs)
    assert [r.params for r in derived.ranks] == [r.params for r in applied.ranks]
    assert [r.coordinates for r in derived.ranks] == [r.coordinates for r in applied.ranks]


def test_uneven_shards_differ_between_ranks_and_add_up() -> None:
    p = torchrig.plan(tiny, world_size=6, tensor_parallel=2, precision="bf16-true")
    assert p.mesh_sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 3, "tp": 2}
    assert len(p.groups()) > 1  # 64 rows over tp=2 then dp_shard=3: 11, 11, 10
    rows = [next(s for s in r.params if s.name == "tok.weight").local_shape[0] for r in p.ranks]
    assert rows == [11, 11, 11, 11, 10, 10]
    assert sum(rows[::2]) == 32  # one tp column of the mesh holds its half once
    assert p.ranks[0].param_bytes == 2 * sum(s.local_numel for s in p.ranks[0].params)  # bf16


def test_plan_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="= 8, but the world size is 6"):
        torchrig.plan(tiny, world_size=6, data_parallel_shard=4, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"ranks=\[9\] are not ranks of a 4-rank job \(0 to 3\)"):
        torchrig.plan(tiny, world_size=4, ranks=[0, 9])
    with pytest.raises(ValueError, match="tensor_parallel=2 needs a plan saying how to split Linear"):
        torchrig.plan(lambda: __import__("torch").nn.Linear(4, 4), world_size=2, tensor_parallel=2)
    with pytest.raises(ValueError, match="unknown precision='fp8'"):
        torchrig.plan(tiny, world_size=2, precision="fp8")
    with pytest.raises(ValueError, match="precision='auto' is not one the planner sizes; use one of 16-mixed, 16-true"):
        torchrig.plan(tiny, world_size=2, precision="auto")


def test_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--devices",
                "2",
                "--num-nodes",
                "2",
                "--tp",
                "2",
                "--rank",
                "3",
                "--json",
                "torchrig.demo.transformer:tiny",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and [r["rank"] for r in out["ranks"]] == [3]
    assert out["ranks"][0]["coordinates"] == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "tp": 1}
    assert main(["plan", "--devices", "4", "--tp", "2", "torchrig.demo.transformer:tiny"]) == 0
    text = capsys.readouterr().out
    assert "layers.0.mlp.up.weight    (128, 32) -> (32, 32)  dp_shard:_S(0, 2), tp:S(0)" in text
    assert main(["plan", "--devices", "4", "--tp", "3", "torchrig.demo.transformer:tiny"]) == 2
    assert capsys.readouterr().err.startswith("torchrig plan: data_parallel_shard='auto' takes what")
    assert main(["plan", "--devices", "4", "torchrig.demo.transformer"]) == 2
    assert "must be MODULE:FUNCTION" in capsys.readouterr().err
    assert main(["plan", "--devices", "4", "torchrig.demo.transformer:nothing"]) == 2
    assert "module 'torchrig.demo.transformer' has no 'nothing'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (["--devices", "0"], "--devices=0 must be an int >= 1 (processes per node)"),
        (["--devices", "2", "--num-nodes", "-1"], "--num-nodes=-1 must be an int >= 1 (the number of machines)"),
        (
            ["--devices", "2", "--dp-shard", "x"],
            "--dp-shard='x' must be a count (an int >= 1) or 'auto' (what is left)",
        ),
        (["--devices", "2", "--tp", "0"], "tensor_parallel=0 must be an int >= 1"),
        (["--devices", "2", "--precision", "fp16"], "unknown precision='fp16'; choose from 32-true"),
        (["--devices", "2", "--rank", "5"], "ranks=[5] are not ranks of a 2-rank job (0 to 1)"),
    ],
)
def test_a_wrong_option_is_one_line_and_exit_2(
    options: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *options, "torchrig.demo.transformer:tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchrig plan: {error}") and err.count("\n") == 1, err


@pytest.mark.slow  # a fake forward and backward for every rank: 2.9 s of CPU (measured on the shared 2-core machine)
def test_a_fake_forward_and_backward_checks_the_plan_against_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from torchrig.demo.transformer import Transformer, tokens_1b

    p = torchrig.plan(transformer_1b, world_size=64, tensor_parallel=8, step_input=tokens_1b)
    assert p.step_outputs == {0: (2, 16, 32000)}  # the logits, gathered by the column-split head
    assert "forward + backward as rank 0 on fake tensors: output (2, 16, 32000)" in p.report()
    # 2 heads cannot be split over 4 tensor-parallel ranks: the attention's reshape fails
    with pytest.raises(
        RuntimeError,
        match=r"the forward/backward as rank 0 failed under this plan \(on fake "
        r"tensors\): RuntimeError: shape '\[2, 8, -1, 16\]' is invalid",
    ):
        torchrig.plan(
            lambda: Transformer(vocab=64, dim=32, layers=1, heads=2),
            world_size=4,
            tensor_parallel=4,
            step_input=lambda: torch.randint(0, 64, (2, 8)),
        )
    assert not dist.is_initialized()
    args = ["plan", "--devices", "8", "--tp", "8", "--input", "torchrig.demo.transformer:tokens_1b"]
    assert main([*args, "torchrig.demo.transformer:transformer_1b"]) == 0
    assert "forward + backward as rank 0 on fake tensors: output (2, 16, 32000)" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_plan_of_a_pipeline_on_128_ranks() -> None:
    # pp=4 x dp_shard=4 x tp=8: the strategy applied once per stage, the other 124 ranks derived
    p = torchrig.plan(transformer_1b, world_size=128, pipeline_parallel=4, tensor_parallel=8)
    assert p.mesh_sizes == {"pp": 4, "dp_replicate": 1, "dp_shard": 4, "tp": 8}
    assert len(p.groups()) == 4  # one layout per stage
    assert p.ranks[37].coordinates == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 5}
    # 18 blocks over 4 stages: 5, 5, 4, 4; the embedding on the first stage, norm and head on the last
    assert [p.ranks[r].stages for r in (0, 32, 64, 127)] == [(0,), (1,), (2,), (3,)]
    assert p.ranks[0].stage_modules == ("layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "tok")
    assert p.ranks[127].stage_modules[-2:] == ("norm", "head")
    names = [{s.name for s in p.ranks[r].params} for r in (0, 32, 64, 96)]
    assert "tok.weight" in names[0] and "head.weight" in names[3] and not names[1] & names[2]
    assert len(set().union(*names)) == sum(len(n) for n in names) == 217 + 3  # every parameter on one stage
    # each stage's tensors split 32 ways (tp=8 x dp_shard=4) or 4 (norms, dp_shard only)
    q = next(s for s in p.ranks[37].params if s.name == "layers.5.attn.q.weight")
    assert (q.shape, q.local_shape) == ((2048, 2048), (64, 2048))
    # 1F1B: stage s keeps up to pp - s microbatches in flight; bubble (pp - 1) / (microbatches + pp - 1)
    assert [p.ranks[r].in_flight for r in (0, 32, 64, 96)] == [4, 3, 2, 1]
    assert (p.schedule, p.microbatches) == ("Schedule1F1B", 8)
    assert p.bubble == pytest.approx(3 / 11)
    text = p.report(max_params=0)
    assert "pipeline schedule Schedule1F1B, 8 microbatches, bubble 27.3% of a step" in text
    assert "ranks 96-127: stage 3 (layers.14-17, norm, head), activations of up to 1 microbatches in flight" in text
