"""Mesh sizes, tensor-parallel plans and ModelParallelStrategy's arguments: the errors say what to change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchrig
from torchrig import parallel
from torchrig.demo.transformer import tiny


@pytest.mark.parametrize(
    ("world", "pp", "replicate", "shard", "tp", "expected"),
    [
        (8, 1, 1, "auto", 2, (1, 1, 4, 2)),
        (8, 1, 2, "auto", 2, (1, 2, 2, 2)),
        (4, 1, 1, 2, 2, (1, 1, 2, 2)),
        (64, 1, 1, "auto", 8, (1, 1, 8, 8)),
        (1, 1, 1, "auto", 1, (1, 1, 1, 1)),
        (128, 4, 1, "auto", 8, (4, 1, 4, 8)),  # the pipeline is the outermost dimension
        (4, 2, 1, 2, 1, (2, 1, 2, 1)),
    ],
)
def test_mesh_sizes(
    world: int, pp: int, replicate: int, shard: int | str, tp: int, expected: tuple[int, int, int, int]
) -> None:
    got = parallel.mesh_sizes(
        world, data_parallel_replicate=replicate, data_parallel_shard=shard, tensor_parallel=tp, pipeline_parallel=pp
    )
    assert got == expected


def test_sizes_that_do_not_multiply_to_the_world_show_the_arithmetic_and_a_valid_choice() -> None:
    with pytest.raises(ValueError) as err:
        parallel.mesh_sizes(8, data_parallel_replicate=1, data_parallel_shard=3, tensor_parallel=2)
    assert str(err.value) == (
        "data_parallel_replicate=1 x data_parallel_shard=3 x tensor_parallel=2 = 6, but the world size is 8 "
        "(devices x num_nodes); the sizes must multiply to it. for example tensor_parallel=2, "
        "data_parallel_shard=4, data_parallel_replicate=1 (1 x 4 x 2 = 8)"
    )
    with pytest.raises(
        ValueError,
        match=r"'auto' takes what data_parallel_replicate=1 x tensor_parallel=4 = 4 leave "
        r"of the world size 6, but 6 is not a multiple of 4; for example tensor_parallel=2, "
        r"data_parallel_shard=3",
    ):
        parallel.mesh_sizes(6, data_parallel_replicate=1, data_parallel_shard="auto", tensor_parallel=4)
    with pytest.raises(ValueError) as err:
        parallel.mesh_sizes(8, data_parallel_replicate=1, data_parallel_shard=2, tensor_parallel=2, pipeline_parallel=3)
    assert str(err.value) == (
        "pipeline_parallel=3 x data_parallel_replicate=1 x data_parallel_shard=2 x tensor_parallel=2 = 12, but the "
        "world size is 8 (devices x num_nodes); the sizes must multiply to it. for example tensor_parallel=2, "
        "data_parallel_shard=4, data_parallel_replicate=1 (1 x 4 x 2 = 8)"
    )
    with pytest.raises(ValueError, match=r"for example pipeline_parallel=2, tensor_parallel=2, data_parallel_shard=2"):
        parallel.mesh_sizes(8, data_parallel_replicate=1, data_parallel_shard=3, tensor_parallel=2, pipeline_parallel=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel=0 must be an int >= 1"),
        ({"data_parallel_replicate": 1.5}, "data_parallel_replicate=1.5 must be an int, not float"),
        ({"data_parallel_shard": "all"}, r"data_parallel_shard='all' must be an int, not str \(or 'auto'\)"),
        ({"data_parallel_shard": 0}, r"data_parallel_shard=0 must be an int >= 1 \(or 'auto'\)"),
        ({"tensor_parallel": True}, "tensor_parallel=True must be an int, not bool"),
        ({"pipeline_parallel": 0}, "pipeline_parallel=0 must be an int >= 1"),
        ({"pp_microbatches": 0}, r"pp_microbatches=0 must be an int >= 1 \(or None: 2 x the stages\)"),
        ({"pp_schedule": "1f1b"}, "pp_schedule='1f1b' is not a pipeline schedule; use one of 'GPipe', '1F1B', "),
    ],
)
def test_strategy_refuses_bad_sizes_when_made(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        torchrig.ModelParallelStrategy(**kwargs)  # type: ignore[arg-type]


def test_strategy_mesh_sizes_for_a_world_and_the_registry_name() -> None:
    strategy = torchrig.ModelParallelStrategy(data_parallel_replicate=2, tensor_parallel=4)
    assert strategy.mesh_sizes(32) == (1, 2, 4, 4)
    with pytest.raises(ValueError, match="= 8, but the world size is 12"):
        torchrig.ModelParallelStrategy(data_parallel_shard=2, tensor_parallel=4).mesh_sizes(12)
    assert isinstance(torchrig.STRATEGY_REGISTRY.get("model_parallel"), torchrig.ModelParallelStrategy)


def test_strategy_refuses_parallelize_with_tp_plan_and_a_plan_that_is_not_a_dict() -> None:
    with pytest.raises(ValueError, match="pass parallelize= or tp_plan=, not both"):
        torchrig.ModelParallelStrategy(parallelize=lambda m, mesh: m, tp_plan={"a": "colwise"})
    with pytest.raises(TypeError, match=r"tp_plan=\['a'\] must be a non-empty dict"):
        torchrig.ModelParallelStrategy(tp_plan=["a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parallelize=3 must be a function"):
        torchrig.ModelParallelStrategy(parallelize=3)  # type: ignore[arg-type]


def test_plan_patterns_expand_to_module_names() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    resolved = parallel.resolve_tp_plan(tiny(), {"layers.*.mlp.up": "colwise", "layers.1.mlp.down": "rowwise"})
    assert sorted(resolved) == ["layers.0.mlp.up", "layers.1.mlp.down", "layers.1.mlp.up"]
    assert isinstance(resolved["layers.0.mlp.up"], ColwiseParallel)
    assert isinstance(resolved["layers.1.mlp.down"], RowwiseParallel)
    embedding = parallel.resolve_tp_plan(tiny(), {"tok": "rowwise"})["tok"]
    assert isinstance(embedding, RowwiseParallel)
    assert embedding.input_layouts[0].is_replicate()  # token ids arrive whole on every rank


def test_plan_naming_no_module_says_so_with_close_names() -> None:
    with pytest.raises(ValueError) as err:
        parallel.resolve_tp_plan(tiny(), {"blocks.*.mlp.up": "colwise"})
    assert str(err.value) == (
        "tp_plan key 'blocks.*.mlp.up' names no submodule of Transformer (modules named like it: layers.0.mlp.up, "
        "layers.1.mlp.up); keys are module names as model.named_modules() gives them, with * for any one part "
        "(e.g. 'layers.*.mlp.up')"
    )


def test_plan_on_an_unsupported_module_type_or_style_is_refused() -> None:
    with pytest.raises(TypeError) as err:
        parallel.resolve_tp_plan(tiny(), {"layers.0.norm1": "colwise"})
    assert str(err.value) == (
        "tp_plan['layers.0.norm1'] = 'colwise' cannot split layers.0.norm1 (LayerNorm): 'colwise' takes Linear, "
        "Embedding. Leave it out of the plan (it stays replicated) or pass a ParallelStyle written for it"
    )
    with pytest.raises(
        ValueError,
        match=r"tp_plan\['head'\] = 'diagonal' is not a tensor-parallel style; use one of "
        r"colwise, colwise_rep",
    ):
        parallel.resolve_tp_plan(tiny(), {"head": "diagonal"})


def test_total_norm_of_plain_gradients_equals_torch() -> None:
    grads = [torch.randn(3, 4), torch.randn(5)]
    for p in (2.0, 1.0, float("inf")):
        want = torch.nn.utils.get_total_norm(grads, p)
        assert torch.allclose(parallel.total_norm(grads, p), want)
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    norm = parallel.clip_grad_norm_(params, max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)
    assert torch.allclose(params[0].grad, torch.tensor([0.6, 0.0, 0.0]), atol=1e-6)


def test_a_rig_with_sizes_that_do_not_fit_fails_before_starting_processes() -> None:
    strategy = torchrig.ModelParallelStrategy(data_parallel_shard=3, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"= 6, but the world size is 2 \(devices x num_nodes\)"):
        torchrig.Rig(accelerator="cpu", devices=2, strategy=strategy)
    assert strategy._launcher is None  # no process was started


def test_the_plans_of_submodules_are_collected_with_their_place() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny()
            self.extra = nn.Linear(4, 4)

    plan = parallel.collect_tp_plan(Wrapper())
    assert plan is not None and plan["net.layers.*.mlp.up"] == "colwise" and plan["net.tok"] == "rowwise"
    assert len(plan) == len(tiny()._tp_plan)
    assert parallel.collect_tp_plan(nn.Linear(2, 2)) is None
    assert "net.layers.1.attn.o" in parallel.resolve_tp_plan(Wrapper(), plan)


def test_errors_inherited_from_fsdp_name_this_strategy() -> None:
    strategy = torchrig.ModelParallelStrategy()
    strategy.parallel_devices = [torch.device("mps")]
    with pytest.raises(ValueError, match=r"strategy='model_parallel' does not run on mps"):
        strategy.backend()
    with pytest.raises(ValueError, match=r"not in any module prepared with strategy='model_parallel'"):
        strategy.setup_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_the_unknown_style_error_lists_every_style_it_takes() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    with pytest.raises(ValueError) as err:
        parallel.resolve_tp_plan(tiny(), {"head": "diagonal"})
    assert str(err.value) == (
        "tp_plan['head'] = 'diagonal' is not a tensor-parallel style; use one of colwise, colwise_rep, colwise_seq, "
        "rowwise, rowwise_seq, sequence, sequence_parallel, rowwise_embedding, rowwise_seq_embedding, "
        "colwise_gather_output, embedding_rowwise, embedding_colwise, rowwise_split_input, rowwise_rep, "
        "replicated_with_grad_allreduce, replicate or a torch.distributed.tensor.parallel.ParallelStyle"
    )
    # every name it lists is accepted (the embedding variants were listed nowhere and failed with a KeyError)
    for name in ("rowwise_embedding", "rowwise_seq_embedding", "embedding_rowwise", "embedding_colwise"):
        assert isinstance(parallel.resolve_tp_plan(tiny(), {"tok": name})["tok"], RowwiseParallel | ColwiseParallel)


def test_hugging_face_style_names_become_the_pytorch_styles_that_compute_the_same() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {
        "head": "colwise_gather_output",
        "tok": "embedding_rowwise",
        "layers.0.mlp.down": "rowwise_split_input",
        "layers.1.mlp.down": "rowwise_rep",
        "layers.0.norm1": "replicated_with_grad_allreduce",
        "layers.1.norm1": "replicate",
    }
    resolved = parallel.resolve_tp_plan(tiny(), plan)
    assert sorted(resolved) == ["head", "layers.0.mlp.down", "layers.0.norm1", "layers.1.mlp.down", "tok"]
    assert isinstance(resolved["head"], ColwiseParallel) and resolved["head"].output_layouts[0].is_replicate()
    for name in ("tok", "layers.0.mlp.down", "layers.1.mlp.down"):  # the input arrives whole on every rank
        assert isinstance(resolved[name], RowwiseParallel) and resolved[name].input_layouts[0].is_replicate()
    assert isinstance(resolved["layers.0.norm1"], SequenceParallel)
    with pytest.raises(TypeError, match=r"'embedding_rowwise' cannot split head \(Linear\): 'embedding_rowwise' takes"):
        parallel.resolve_tp_plan(tiny(), {"head": "embedding_rowwise"})


@pytest.mark.parametrize("style", ["packed_colwise", "packed_rowwise", "moe_tp_experts", "mla_kv_a_proj", "all_reduce"])
def test_hugging_face_styles_without_a_pytorch_equivalent_say_what_to_do(style: str) -> None:
    with pytest.raises(ValueError) as err:
        parallel.resolve_tp_plan(tiny(), {"layers.*.mlp.up": style})
    assert str(err.value) == (
        f"tp_plan['layers.*.mlp.up'] = '{style}' is a Hugging Face transformers style that no PyTorch ParallelStyle "
        "reproduces (it needs transformers' own sharding code); pass tp_plan= without 'layers.*.mlp.up' (the module "
        "stays whole), a torch.distributed.tensor.parallel.ParallelStyle for it, or parallelize=fn(model, mesh)"
    )


def test_every_style_transformers_registers_is_mapped_or_refused() -> None:
    pytest.importorskip("transformers")
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert styles too)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    known = set(parallel._styles()) | set(parallel._HF_ONLY)
    assert set(ALL_PARALLEL_STYLES.valid_keys()) - known == set()


class _Layout(torchrig.ModelParallelStrategy):
    """pp=2 x dp_shard=2 x tp=2 on 8 ranks, seen from rank ``rank`` (no process group)."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__(pipeline_parallel=2, tensor_parallel=2)
        self.rank = rank

    @property
    def world_size(self) -> int:
        return 8

    @property
    def global_rank(self) -> int:
        return self.rank

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        # every rank holds its data-parallel rank's batch: ``tensor`` shifted by 100 x that rank
        return torch.stack([tensor + 100 * _Layout(r).data_parallel_rank for r in range(8)])


def test_a_batch_is_gathered_once_per_data_parallel_rank() -> None:
    from types import SimpleNamespace

    from torchrig.gather import gather_for_metrics

    layout = _Layout()
    assert layout.data_parallel_size == 2
    # the first rank of each data-parallel rank: pipeline stage 0, tensor-parallel rank 0
    assert layout.data_parallel_sources() == [0, 2]
    assert [_Layout(r).data_parallel_rank for r in layout.data_parallel_sources()] == [0, 1]
    # the 2 x 2 peers of each data-parallel rank share its batch: it comes back once, interleaved
    rig = SimpleNamespace(world_size=8, strategy=layout, current_loader=None)
    out = gather_for_metrics(rig, torch.tensor([1.0, 2.0]))  # type: ignore[arg-type]
    assert out.tolist() == [1.0, 101.0, 2.0, 102.0]
