"""Cutting a model into pipeline stages (``torchrig.pipelining``): the split, the pruned stages and the errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrig import pipelining
from torchrig.demo.transformer import Transformer


def model(layers: int = 4) -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab=64, dim=16, layers=layers, heads=2)


def test_blocks_split_evenly_and_the_rest_goes_to_the_first_and_last_stage() -> None:
    split = pipelining.split_model(model(5), 2)
    assert split.blocks == (("layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4"))
    assert split.others == (("tok",), ("norm", "head"))
    split = pipelining.split_model(model(4), 3, ["layers.1", "layers.3"])
    assert split.blocks == (("layers.0",), ("layers.1", "layers.2"), ("layers.3",))
    assert split.module_names(2) == ["layers.3", "norm", "head"]


def test_stages_keep_the_original_names_and_chain_to_the_whole_model() -> None:
    whole = model(4)
    tokens = torch.randint(0, 64, (2, 5))
    want = whole(tokens)
    split = pipelining.split_model(whole, 2)
    first = pipelining.prune(whole, split, [0], in_place=False)
    last = pipelining.prune(whole, split, [1], in_place=False)
    assert sorted(dict(first.named_parameters())) == sorted(
        k for k, _ in whole.named_parameters() if k.startswith(("tok.", "layers.0.", "layers.1."))
    )
    assert {k.split(".")[0] + "." + k.split(".")[1] for k, _ in last.named_parameters() if k.startswith("layers")} == {
        "layers.2",
        "layers.3",
    }
    assert isinstance(first.head, pipelining.Passthrough) and isinstance(last.tok, pipelining.Passthrough)
    assert len(whole.layers) == 4  # the views leave the model whole
    assert torch.allclose(last(first(tokens)), want)
    # in place: the model keeps only its stage
    pipelining.prune(whole, split, [1], in_place=True)
    assert [k for k, _ in whole.layers.named_children()] == ["2", "3"]


def test_stage_indices_of_each_schedule() -> None:
    gpipe, interleaved, zbv = (pipelining.schedule_class(n) for n in ("GPipe", "Interleaved1F1B", "ZBVZeroBubble"))
    assert pipelining.stage_indices(gpipe, 1, 4) == [1]
    assert pipelining.stage_indices(interleaved, 1, 4) == [1, 5]  # looped
    assert pipelining.stage_indices(zbv, 1, 4) == [1, 6]  # V: the last stage comes back to rank 0
    assert pipelining.last_stage_rank(zbv, 4) == 0 and pipelining.last_stage_rank(interleaved, 4) == 3
    assert pipelining.schedule_class(gpipe) is gpipe


@pytest.mark.parametrize(
    ("layers", "stages", "split", "message"),
    [
        (
            2,
            4,
            None,
            r"pipeline_parallel: Transformer has 2 repeated blocks \(two or more children of one class in an "
            r"nn.ModuleList or nn.Sequential\) but 4 stages were asked for; each stage needs at least one block: "
            r"use at most 2 stages",
        ),
        (
            4,
            2,
            ["layers.9"],
            r"pp_split names 'layers.9', which is not a repeated block of Transformer; name the first block of a "
            r"stage as model.named_modules\(\) gives it \(layers.0, layers.1, layers.2, ...\)",
        ),
        (4, 2, ["head"], r"pp_split names 'head', which is not a repeated block"),
        (
            4,
            3,
            ["layers.2", "layers.2"],
            r"pp_split=\['layers.2', 'layers.2'\] leaves stage 1 without blocks .* list the names in the model's "
            r"order, each stage starting at a later block",
        ),
        (4, 2, ["layers.0"], r"pp_split=\['layers.0'\] leaves stage 0 without blocks"),
        (4, 3, ["layers.2"], r"pp_split=\['layers.2'\] must list 2 module names \(the first block of each stage"),
    ],
)
def test_split_errors_say_what_to_change(layers: int, stages: int, split: list[str] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipelining.split_model(model(layers), stages, split)


def test_parameters_next_to_the_blocks_are_refused() -> None:
    class WithPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(8, 4))
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    with pytest.raises(ValueError, match=r"WithPositions holds parameters \['pos'\] itself, next to its blocks"):
        pipelining.split_model(WithPositions(), 2)


def test_strategy_arguments_are_checked_when_made() -> None:
    import torchrig

    with pytest.raises(TypeError, match=r"pp_split='layers.2' must be a list of module names"):
        torchrig.ModelParallelStrategy(pipeline_parallel=2, pp_split="layers.2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pp_schedule=3 is not a pipeline schedule"):
        torchrig.ModelParallelStrategy(pipeline_parallel=2, pp_schedule=3)  # type: ignore[arg-type]
    strategy = torchrig.ModelParallelStrategy(pipeline_parallel=2, tensor_parallel=2)
    assert strategy.mesh_sizes(8) == (2, 1, 2, 2)
    assert "pipeline_parallel=2, pp_schedule='1F1B'" in repr(strategy)


def test_forward_backward_is_a_step_on_one_process() -> None:
    import torchrig

    rig = torchrig.Rig(accelerator="cpu")
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    want = nn.functional.mse_loss(net(x), y)
    want.backward()
    grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad()
    prepared = rig.prepare(net)
    loss = rig.forward_backward(prepared, nn.functional.mse_loss, x, target=y)
    assert torch.equal(loss, want.detach()) and not loss.requires_grad
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads, strict=True))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="forward_backward\\(\\) takes the module prepare\\(\\) returned; got a Linear"):
        rig.forward_backward(net, nn.functional.mse_loss, x, target=y)


def test_a_stage_called_outside_the_schedule_refuses() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        whole = model(2)
        pipeline = pipelining.apply_pp(whole, init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)), schedule="GPipe")
        assert pipelining.pipeline_of(whole) is pipeline and pipeline.microbatches == 2
        with pytest.raises(RuntimeError, match=r"Transformer is cut into pipeline stages \(pipeline_parallel\): "):
            whole(torch.zeros(2, 3, dtype=torch.long))
        # the one-stage schedule itself runs it: forward and backward of both microbatches
        loss = pipeline.step(
            lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
            (torch.zeros(4, 3, dtype=torch.long),),
            torch.zeros(4, 3, dtype=torch.long),
            torch.device("cpu"),
        )
        assert loss.shape == () and all(p.grad is not None for p in whole.parameters())
    finally:
        dist.destroy_process_group()


class Outer(nn.Module):
    """A model around the one cut into stages (as a TrainingModule holds its network)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_the_model_outside_the_schedule_runs_forward_only_and_its_parts_refuse() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outer = Outer()
        tokens = torch.randint(0, 64, (4, 5))
        with torch.no_grad():
            want = outer(tokens)
        pipeline = pipelining.apply_pp(outer, init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)), schedule="1F1B")
        assert type(outer).__name__ == "Outer" and isinstance(outer, Outer)
        with torch.no_grad():  # a forward-only schedule: 2 microbatches of 2, then 1 of 3 (2 does not divide 3)
            assert torch.allclose(outer(tokens), want, atol=1e-6)  # microbatches: equal up to rounding
            assert torch.allclose(outer(tokens[:3]), want[:3], atol=1e-6)
        assert set(pipeline._forward) == {((4, 5),), ((3, 5),)}  # a schedule per batch shape
        with pytest.raises(
            RuntimeError,
            match=r"Outer is cut into pipeline stages \(pipeline_parallel\): model\(x\) with "
            r"gradients on would run only stage 0 of 1\. .*self\.forward_loss\(loss_fn, x, target=y\)",
        ):
            outer(tokens)
        # the network inside, called alone, would run this rank's stage only
        with (
            torch.no_grad(),
            pytest.raises(
                RuntimeError,
                match=r"Transformer is part of a model cut into pipeline "
                r"stages \(pipeline_parallel\): called alone it would run only stage 0",
            ),
        ):
            outer.net(tokens)
    finally:
        dist.destroy_process_group()


def test_a_loss_with_a_graph_under_pipeline_parallel_is_refused() -> None:
    from torchrig.trainer.step_runner import _backward_ran

    _backward_ran(torch.ones(()))  # the schedule's loss: detached, its backward done
    with pytest.raises(
        RuntimeError,
        match=r"training_step returned a loss that still needs a backward, but under "
        r"pipeline_parallel .* loss = self\.forward_loss\(loss_fn, x, target=y\)",
    ):
        _backward_ran(torch.ones((), requires_grad=True) * 2)
