"""Checkpoints across process layouts: 2 DDP processes -> 1 process -> 2 DDP processes, and FSDP
sharded (each rank writes its shards) -> ``consolidate`` into one safetensors file.

The 2-process parts run this file as a script under torchrun-style environment variables
(gloo, CPU). Run by hand: ``python tests/unit/test_checkpoint_distributed.py PHASE DIR`` with
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import torchrig

ROOT = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(rig: torchrig.Rig) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = rig.prepare(Net())
    return model, rig.prepare(torch.optim.Adam(model.parameters(), lr=0.01))


def step(rig: torchrig.Rig, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(100 + rig.global_rank)  # each rank its own data
    x = torch.randn(4, 6, generator=g)
    rig.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def flat(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights and Adam moments under stable names, for bitwise comparison."""
    out = {f"w.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = dict(enumerate(n for n, _ in model.module.named_parameters()))
    for i, s in optimizer.state_dict()["state"].items():
        out[f"m.{names[i]}"] = s["exp_avg"].clone()
    return out


def next_draws() -> torch.Tensor:
    """What this process's RNGs give next (torch's and Python's), as a tensor to compare."""
    return torch.cat([torch.rand(3, dtype=torch.float64), torch.tensor([random.random()], dtype=torch.float64)])


def save_draws(path: Path) -> None:
    safetensors.torch.save_file({"draws": next_draws()}, str(path))


def saved_draws(path: Path) -> torch.Tensor:
    return safetensors.torch.load_file(str(path))["draws"]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- the worker phases ------------------------------------------------------------------------
def ddp_save(folder: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
    model, optimizer = build(rig)
    for _ in range(2):
        step(rig, model, optimizer)
    torch.manual_seed(1000 + rig.global_rank)  # each rank's RNGs at their own state
    random.seed(1000 + rig.global_rank)
    rig.save(folder / "ddp", {"model": model, "optimizer": optimizer, "step": 2})
    save_draws(folder / f"ddp-draws-{rig.global_rank}.safetensors")  # what each rank draws next
    if rig.is_global_zero:
        safetensors.torch.save_file(flat(model, optimizer), str(folder / "ddp-ref.safetensors"))


def ddp_load_then_fsdp(folder: Path) -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
    model, optimizer = build(rig)
    rig.load(folder / "ddp", {"model": model, "optimizer": optimizer})  # as many processes: each its own RNGs
    assert torch.equal(next_draws(), saved_draws(folder / f"ddp-draws-{rig.global_rank}.safetensors"))
    left = rig.load(folder / "single", {"model": model, "optimizer": optimizer})
    assert left == {"step": 3}, left
    assert torch.equal(next_draws(), saved_draws(folder / "single-draws.safetensors"))  # 1 process's, on each
    assert_same(flat(model, optimizer), safetensors.torch.load_file(str(folder / "single-ref.safetensors")))
    (folder / f"ok-ddp-{rig.global_rank}").touch()

    fsdp = torchrig.Rig(accelerator="cpu", devices=2, strategy="fsdp")
    model, optimizer = build(fsdp)
    step(fsdp, model, optimizer)
    fsdp.save(folder / "fsdp", {"model": model, "optimizer": optimizer, "step": 1})
    full = fsdp.strategy.module_state_dict(model)
    other, other_opt = build(fsdp)
    fsdp.load(folder / "fsdp", {"model": other, "optimizer": other_opt})
    step(fsdp, model, optimizer)  # the same next step from the saved and the loaded state
    step(fsdp, other, other_opt)
    after, other_after = fsdp.strategy.module_state_dict(model), fsdp.strategy.module_state_dict(other)
    if fsdp.is_global_zero:
        safetensors.torch.save_file({k: v.contiguous() for k, v in full.items()}, str(folder / "fsdp-ref.safetensors"))
        assert_same(after, other_after)
    fsdp.barrier()
    (folder / f"ok-fsdp-{fsdp.global_rank}").touch()


# -- the test ---------------------------------------------------------------------------------
def launch(
    phase: str, folder: Path, *, script: str = __file__, extra_env: dict[str, str] | None = None, check: bool = True
) -> list[tuple[int, str]]:
    """Run ``script PHASE FOLDER`` as the 2 ranks of a gloo process group (torchrun's variables);
    each rank's exit code and output (with ``check``, every rank must exit with 0)."""
    from torchrig.strategies.launch import find_free_port

    port = str(find_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        for var in [v for v in env if v.startswith("TORCHRIG_")]:
            del env[var]
        env.update(extra_env or {})
        cmd = [sys.executable, script, phase, str(folder)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=90)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 or not check, f"rank {rank} of {phase} failed:\n{out[-3000:]}"
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_ddp_two_to_one_and_back_and_fsdp_sharded(tmp_path: Path) -> None:
    from torchrig.checkpoint import consolidate, describe

    launch("ddp-save", tmp_path)
    assert describe(tmp_path / "ddp")["world_size"] == 2
    rig = torchrig.Rig(accelerator="cpu")
    model, optimizer = build(rig)
    assert rig.load(tmp_path / "ddp", {"model": model, "optimizer": optimizer}) == {"step": 2}
    # saved by 2 processes, loaded by 1: rank 0's RNG states (each rank's is stored, see below)
    assert torch.equal(next_draws(), saved_draws(tmp_path / "ddp-draws-0.safetensors"))
    assert not torch.equal(
        saved_draws(tmp_path / "ddp-draws-0.safetensors"), saved_draws(tmp_path / "ddp-draws-1.safetensors")
    )
    assert_same(flat(model, optimizer), safetensors.torch.load_file(str(tmp_path / "ddp-ref.safetensors")))
    step(rig, model, optimizer)
    rig.save(tmp_path / "single", {"model": model, "optimizer": optimizer, "step": 3})
    save_draws(tmp_path / "single-draws.safetensors")
    safetensors.torch.save_file(flat(model, optimizer), str(tmp_path / "single-ref.safetensors"))

    launch("ddp-load-fsdp", tmp_path)
    assert {p.name for p in tmp_path.glob("ok-*")} == {"ok-ddp-0", "ok-ddp-1", "ok-fsdp-0", "ok-fsdp-1"}
    info = describe(tmp_path / "fsdp")
    assert info["sharded"] and info["world_size"] == 2
    assert info["parameters"] == sum(p.numel() for p in Net().parameters())
    assert all(ok for _, _, ok in info["verified"])
    assert any(name.endswith(".distcp") for name, _, _ in info["verified"])
    out = consolidate(tmp_path / "fsdp", tmp_path / "model.safetensors")
    got, want = (
        safetensors.torch.load_file(str(out)),
        safetensors.torch.load_file(str(tmp_path / "fsdp-ref.safetensors")),
    )
    assert_same(got, want)


if __name__ == "__main__":
    phases = {"ddp-save": ddp_save, "ddp-load-fsdp": ddp_load_then_fsdp}
    phases[sys.argv[1]](Path(sys.argv[2]))
