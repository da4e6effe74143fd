"""Checks that need a real accelerator (run on the lent GPU machine: PYTHONPATH=src pytest tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchrig


def _kind() -> str:
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return acc.type


def test_auto_picks_the_accelerator_and_batches_arrive_there() -> None:
    rig = torchrig.Rig()
    assert rig.device.type == _kind()
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = rig.prepare(torch.utils.data.DataLoader(ds, batch_size=8))
    x, y = next(iter(loader))
    assert x.device.type == _kind() and y.device.type == _kind()


def test_auto_precision_is_bf16_mixed_where_native() -> None:
    want = "bf16-mixed" if "bf16-mixed" in torchrig.precision.supported_precisions(_kind()) else "32-true"
    assert torchrig.Rig(precision="auto").precision.name == want


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true", "32-true"])
def test_every_precision_trains(precision: str) -> None:
    if precision not in torchrig.precision.supported_precisions(_kind()):
        pytest.skip(f"{precision} not supported on {_kind()}")
    torch.manual_seed(0)
    rig = torchrig.Rig(precision=precision)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = rig.prepare(model, opt)
    x, y = rig.to_device((torch.randn(64, 8), torch.randn(64, 1)))
    first = None
    for _ in range(50):
        loss = nn.functional.mse_loss(model(x), y)
        first = loss.detach() if first is None else first
        rig.backward(loss)
        opt.step()
        opt.zero_grad()
    assert float(loss) < float(first)


def test_cpu_input_to_gpu_model_is_explained() -> None:
    rig = torchrig.Rig()
    model = rig.prepare(nn.Linear(4, 2))
    with pytest.raises(torchrig.DeviceMismatchError, match="did not come from a prepared dataloader"):
        model(torch.randn(3, 4))


def test_device_stats_report_memory() -> None:
    rig = torchrig.Rig()
    stats = rig.accelerator.get_device_stats(rig.device)
    assert "allocated_bytes" in stats
