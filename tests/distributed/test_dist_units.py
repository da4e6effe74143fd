"""Strategy options, registration, environment detection and the errors for what cannot work."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

import torchrig
from torchrig.clusters import first_slurm_host
from torchrig.strategies import STRATEGY_REGISTRY, DDPStrategy, FSDPStrategy, detect_environment

_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_JOB_NAME",
)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def test_registry_holds_every_layout_with_its_start_method() -> None:
    assert {"single", "ddp", "ddp_spawn", "ddp_notebook", "fsdp"} <= set(STRATEGY_REGISTRY.names())
    assert STRATEGY_REGISTRY.get("ddp").start_method == "popen"
    assert STRATEGY_REGISTRY.get("ddp_spawn").start_method == "spawn"
    assert STRATEGY_REGISTRY.get("ddp_notebook").start_method == "fork"
    assert STRATEGY_REGISTRY.get("fsdp").sharded is True
    assert getattr(STRATEGY_REGISTRY.get("ddp"), "sharded", False) is False


def test_keyword_options_reach_the_strategy() -> None:
    s = DDPStrategy(
        find_unused_parameters=True, static_graph=True, process_group_backend="gloo", timeout=timedelta(seconds=42)
    )
    assert (s.find_unused_parameters, s.static_graph, s.timeout) == (True, True, timedelta(seconds=42))
    assert repr(s) == "DDPStrategy(find_unused_parameters=True, static_graph=True)"
    with pytest.raises(TypeError, match=r"must be a datetime\.timedelta"):
        DDPStrategy(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_method='thread' is not one of popen, spawn, fork"):
        DDPStrategy(start_method="thread")


def test_a_user_strategy_registers_itself_on_definition() -> None:
    class MyDDP(DDPStrategy):
        @classmethod
        def register_strategies(cls, registry):  # type: ignore[no-untyped-def]
            registry.register("my_ddp_test", cls, description="test", override=True, find_unused_parameters=True)

    try:
        built = STRATEGY_REGISTRY.get("my_ddp_test")
        assert isinstance(built, MyDDP) and built.find_unused_parameters
    finally:
        STRATEGY_REGISTRY.remove("my_ddp_test")


def test_auto_picks_ddp_for_several_devices_and_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(torchrig.resolve(accelerator="cpu", devices=2).strategy) is DDPStrategy
    assert torchrig.resolve(accelerator="cpu").strategy.world_size == 1
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    plan = torchrig.resolve(accelerator="cpu")
    assert type(plan.strategy) is DDPStrategy and plan.strategy.world_size == 4
    assert plan.strategy.global_rank == 3


def test_backend_comes_from_pytorch_map_and_is_overridable() -> None:
    strategy = torchrig.resolve(accelerator="cpu", devices=2, strategy="ddp").strategy
    assert strategy.backend() == "gloo"
    custom = torchrig.resolve(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="mpi"))
    assert custom.strategy.backend() == "mpi"


def test_a_device_without_a_backend_is_a_clear_error() -> None:
    strategy = DDPStrategy()
    strategy.parallel_devices = [torch.device("meta")] * 2
    with pytest.raises(
        ValueError,
        match=r"needs a torch.distributed backend for 'meta' devices, but PyTorch has "
        r"none registered .*cpu -> gloo.*process_group_backend=",
    ):
        strategy.backend()


def test_fsdp_where_it_cannot_run_says_what_to_use() -> None:
    strategy = FSDPStrategy()
    strategy.parallel_devices = [torch.device("mps")]
    with pytest.raises(ValueError, match=r"strategy='fsdp' does not run on mps.*Use strategy='ddp'"):
        strategy.backend()
    cpu = torchrig.resolve(accelerator="cpu", devices=2, strategy=FSDPStrategy(cpu_offload=True)).strategy
    with pytest.raises(ValueError, match=r"cpu_offload=True\) .* already on the CPU; drop cpu_offload"):
        cpu._shard_kwargs()


def test_fsdp_wrap_policy_is_classes_or_a_function() -> None:
    by_class = FSDPStrategy(auto_wrap_policy={nn.Linear}).auto_wrap_policy
    assert by_class is not None and by_class(nn.Linear(1, 1)) and not by_class(nn.ReLU())
    by_fn = FSDPStrategy(auto_wrap_policy=lambda m: isinstance(m, nn.ReLU)).auto_wrap_policy
    assert by_fn is not None and by_fn(nn.ReLU())
    with pytest.raises(TypeError, match=r"must hold nn\.Module subclasses"):
        FSDPStrategy(auto_wrap_policy={int})
    with pytest.raises(TypeError, match="must be a set of layer classes"):
        FSDPStrategy(auto_wrap_policy="Linear")  # type: ignore[arg-type]


def test_spawn_strategies_wait_for_launch() -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp_spawn")
    assert rig.strategy.needs_launch and rig.world_size == 2 and rig.global_rank == 0
    launch_first = (
        r"needs the processes that DDPStrategy\(start_method='spawn'\) \(ddp_spawn, ddp_notebook\) starts in "
        r"rig.launch\(fn\): "
    )
    with pytest.raises(RuntimeError, match=rf"^joining the process group {launch_first}"):
        rig.strategy.setup_environment()
    # one process too: prepare() before launch said only "Default process group has not been initialized"
    one = torchrig.Rig(accelerator="cpu", devices=1, strategy="ddp_spawn")
    expected = rf"^rig.prepare\(\) {launch_first}put the training in a function fn\(rig, ...\) and call rig.launch"
    with pytest.raises(RuntimeError, match=expected):
        one.prepare(nn.Linear(2, 2))


@pytest.mark.parametrize("layout", ["ddp_spawn", "ddp_notebook"])
def test_collectives_before_launch_under_spawn_say_to_call_them_in_the_launched_function(layout: str) -> None:
    # They answered as one process (all_reduce gave the input back, barrier waited for nobody).
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy=layout)
    assert rig.world_size == 2  # the run's size is known before launch; its ranks are not there yet
    method = "spawn" if layout == "ddp_spawn" else "fork"
    launch_first = (
        rf"needs the processes that DDPStrategy\(start_method='{method}'\) \(ddp_spawn, ddp_notebook\) starts in "
        r"rig.launch\(fn\): put the training in a function fn\(rig, ...\) and call rig.launch\(fn\), which runs "
        r"it in every process; or use strategy='ddp', which runs the whole script in every process$"
    )
    t = torch.ones(2)
    calls = {
        "all_gather": lambda: rig.all_gather({"t": t}),
        "all_reduce": lambda: rig.all_reduce(t, op="sum"),
        "broadcast": lambda: rig.broadcast({"a": 1}),
        "barrier": lambda: rig.barrier("start"),
        "reduce_boolean_decision": lambda: rig.reduce_boolean_decision(True),
        "all_gather_object": lambda: rig.strategy.all_gather_object(1),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"^the collective {name} {launch_first}"):
            call()
    with pytest.raises(RuntimeError, match=rf"^the collective barrier {launch_first}"), rig.rank_zero_first():
        pass
    with pytest.raises(RuntimeError, match=rf"^rig.preempted\(\) {launch_first}"):
        rig.preempted()
    # one process (devices=1) too: it runs in the launched worker, not here
    with pytest.raises(RuntimeError, match=rf"^the collective all_reduce {launch_first}"):
        torchrig.Rig(accelerator="cpu", devices=1, strategy=layout).all_reduce(t)


def test_a_process_torchrun_started_on_the_cpu_computes_there(monkeypatch: pytest.MonkeyPatch) -> None:
    # (each launcher's detection: tests/unit/test_clusters.py)
    assert detect_environment().kind == "none"
    launched = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    for k, v in launched.items():
        monkeypatch.setenv(k, v)
    assert detect_environment().kind == "torchrun"
    # a process that torchrun started on the CPU computes on the CPU whatever devices= said
    strategy = torchrig.resolve(accelerator="cpu").strategy
    assert strategy.root_device == torch.device("cpu") and strategy.world_size == 4


def test_first_slurm_host() -> None:
    assert first_slurm_host("node[03-05,9],gpu1") == "node03"
    assert first_slurm_host("gpu7") == "gpu7"
    assert first_slurm_host("a1,b2") == "a1"


def test_ddp_spawn_with_an_unpicklable_function_says_why_before_starting() -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp_spawn")
    with pytest.raises(TypeError, match=r"cannot be pickled .* Define it at module level"):
        rig.launch(lambda rig: None)


def test_materialising_shards_warns_about_modules_without_reset_parameters() -> None:
    from torchrig.strategies.base import reset_parameters as _reset_parameters

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

    model = nn.Sequential(nn.Linear(2, 2), Scale())
    with pytest.warns(UserWarning, match=r"no reset_parameters\(\).*1 \(Scale\)"):
        _reset_parameters(model)
    attention = nn.MultiheadAttention(4, 2)  # initialised by its _reset_parameters
    with torch.no_grad():
        attention.in_proj_weight.zero_()
    _reset_parameters(attention)
    assert attention.in_proj_weight.abs().sum() > 0


def test_a_loader_prepare_cannot_shard_gets_a_warning_unless_already_distributed() -> None:
    import warnings

    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(4))

    strategy = torchrig.resolve(accelerator="cpu", devices=2, strategy="ddp").strategy
    stream = DataLoader(Stream())
    message = (
        r"its Stream is an IterableDataset that does not say how to split itself\), so each of the 2 processes reads "
        r"the same data\. Shard it yourself: give Stream a method shard_for_rank\(rank, world_size\)"
    )
    with pytest.warns(UserWarning, match=message):
        assert strategy.process_dataloader(stream) is stream
    sharded = DataLoader(list(range(4)), sampler=DistributedSampler(list(range(4)), num_replicas=2, rank=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strategy.process_dataloader(sharded) is sharded
