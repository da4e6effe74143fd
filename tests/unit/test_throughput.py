"""torchrig.ThroughputMonitor: FLOPs counted on the first batch, samples/items/TFLOP/s/MFU per
logging window, through the loggers; the peak table; bad arguments."""

from __future__ import annotations

import contextlib
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchrig
from torchrig.trainer import throughput
from torchrig.trainer.logger_base import Logger
from torchrig.trainer.throughput import ThroughputMonitor, device_peak_flops, measure_flops

BATCH, IN, HIDDEN, OUT = 4, 6, 5, 3


class ListLogger(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def rows_with(self, key: str) -> dict[int, dict[str, Any]]:
        return {step: row for step, row in self.rows if key in row}


class TwoLinear(torchrig.TrainingModule):
    """Two bias-free Linear layers; with ``items`` ("tensor", "int" or "float") the step returns
    the token-weighted ``{"loss": loss_sum, "num_items": batch_idx + 1}`` (+ 0.5 for "float")."""

    def __init__(self, items: str | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN, bias=False), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT, bias=False)
        )
        self.items = items

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.items is None:
            return torch.nn.functional.mse_loss(self(x), y)
        loss_sum = torch.nn.functional.mse_loss(self(x), y, reduction="sum")
        n = {"tensor": torch.tensor(batch_idx + 1), "int": batch_idx + 1, "float": batch_idx + 1.5}[self.items]
        return {"loss": loss_sum, "num_items": n}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(batches: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * batches, IN, generator=g), torch.randn(BATCH * batches, OUT, generator=g))
    return DataLoader(data, batch_size=BATCH)


def _fit(tmp_path: Path, monitor: ThroughputMonitor, module: torchrig.TrainingModule, batches: int) -> ListLogger:
    logger = ListLogger()
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, _loader(batches))
    return logger


@pytest.fixture
def one_second_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's clock advances one second per reading (it reads it once per window edge)."""
    ticks = iter(range(1000))
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def test_measured_flops_of_a_bias_free_linear_step_are_six_times_params_times_batch() -> None:
    layer = torch.nn.Linear(IN, HIDDEN, bias=False)
    params = IN * HIDDEN
    x = torch.randn(BATCH, IN, requires_grad=True)  # a layer inside a model: its input needs a gradient
    assert measure_flops(lambda: layer(x).sum().backward()) == 6 * params * BATCH
    # The first layer of a model: no gradient for the input, so no input-gradient product.
    assert measure_flops(lambda: layer(x.detach()).sum().backward()) == 4 * params * BATCH
    meta = torch.nn.Linear(1024, 512, bias=False, device="meta")
    xm = torch.empty(8, 1024, device="meta", requires_grad=True)
    assert measure_flops(lambda: meta(xm).sum().backward()) == 6 * 1024 * 512 * 8


def test_measuring_a_compiled_module_leaves_it_to_compile_afterwards() -> None:
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = torch.compile(torch.nn.Linear(IN, HIDDEN, bias=False), backend=backend)
    x = torch.randn(BATCH, IN, requires_grad=True)
    assert measure_flops(lambda: layer(x).sum().backward()) == 6 * IN * HIDDEN * BATCH
    assert graphs == []  # counted eagerly
    layer(x).sum().backward()
    assert len(graphs) == 1  # and compiled at the next call (not skipped for good)
    torch._dynamo.reset()


@pytest.mark.timeout(60)
def test_trainer_logs_samples_tflops_and_mfu_with_a_given_peak(tmp_path: Path, one_second_windows: None) -> None:
    peak = 2.0e4
    monitor = ThroughputMonitor(peak_flops=peak)
    logger = _fit(tmp_path, monitor, TwoLinear(), batches=7)
    # First layer 4 x params x batch (its input needs no gradient), second 6 x.
    flops = (4 * IN * HIDDEN + 6 * HIDDEN * OUT) * BATCH
    assert monitor.flops == flops
    rows = logger.rows_with("throughput/mfu")
    assert sorted(rows) == [2, 4, 6]
    # Batch 0 starts the clock; window to step 2 holds batch 1; later windows two batches; 1 s each.
    batches = {2: 1, 4: 2, 6: 2}
    for step, row in rows.items():
        assert row["throughput/samples_per_sec"] == BATCH * batches[step]
        assert row["throughput/samples_per_sec_per_device"] == BATCH * batches[step]
        assert row["throughput/tflops_per_device"] == pytest.approx(flops * batches[step] / 1e12, rel=1e-12)
        assert row["throughput/mfu"] == pytest.approx(row["throughput/tflops_per_device"] * 1e12 / peak, rel=1e-12)
        assert "throughput/items_per_sec" not in row  # the step returned a plain loss
    assert monitor.last_values == rows[6]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("items", ["tensor", "int", "float"])
def test_items_per_second_from_num_items_in_the_step_output(
    tmp_path: Path, one_second_windows: None, items: str
) -> None:
    monitor = ThroughputMonitor(flops_per_batch=1e6, peak_flops=1e12)
    logger = _fit(tmp_path, monitor, TwoLinear(items=items), batches=5)
    rows = logger.rows_with("throughput/items_per_sec")
    # batch_idx + 1 items per batch; batch 0 uncounted: step 2 has batch 1 (2), step 4 batches 2, 3 (3 + 4).
    half = 0.5 if items == "float" else 0.0
    expected = {2: 2.0 + half, 4: 7.0 + 2 * half}
    assert {s: r["throughput/items_per_sec"] for s, r in rows.items()} == expected
    assert {s: r["throughput/items_per_sec_per_device"] for s, r in rows.items()} == expected
    assert monitor.flops == 1e6  # given: not counted
    assert rows[4]["throughput/tflops_per_device"] == pytest.approx(2 * 1e6 / 1e12, rel=1e-12)
    assert rows[4]["throughput/mfu"] == pytest.approx(2 * 1e6 / 1e12, rel=1e-12)


@pytest.mark.timeout(60)
def test_unknown_device_without_peak_logs_tflops_but_not_mfu_and_warns_once(tmp_path: Path) -> None:
    monitor = ThroughputMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = _fit(tmp_path, monitor, TwoLinear(), batches=5)
        _fit(tmp_path, monitor, TwoLinear(), batches=5)
    texts = [str(w.message) for w in caught if "ThroughputMonitor" in str(w.message)]
    assert texts == [
        "ThroughputMonitor: no known peak FLOP/s for device 'cpu', so MFU is not logged (TFLOP/s is); "
        "pass peak_flops= (FLOP/s of one device) to log it"
    ]
    rows = logger.rows_with("throughput/tflops_per_device")
    assert sorted(rows) == [2, 4] and all(r["throughput/tflops_per_device"] > 0 for r in rows.values())
    assert not logger.rows_with("throughput/mfu")


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA B200", 2250.0),
        ("AMD Instinct MI300X", 1307.4),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_peak_table_matches_device_names(name: str, tflops: float | None) -> None:
    assert device_peak_flops(name) == (None if tflops is None else tflops * 1e12)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"peak_flops": -1.0}, "ThroughputMonitor(peak_flops=-1.0): give a positive finite number, or None"),
        ({"peak_flops": 0}, "ThroughputMonitor(peak_flops=0): give a positive finite number, or None"),
        ({"peak_flops": float("inf")}, "ThroughputMonitor(peak_flops=inf): give a positive finite number"),
        ({"peak_flops": "989e12"}, "ThroughputMonitor(peak_flops='989e12'): give a positive finite number"),
        ({"flops_per_batch": -5}, "ThroughputMonitor(flops_per_batch=-5): give a positive finite number"),
        ({"flops_per_batch": True}, "ThroughputMonitor(flops_per_batch=True): give a positive finite number"),
    ],
)
def test_bad_arguments_say_what_was_given(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError) as raised:
        ThroughputMonitor(**kwargs)
    assert text in str(raised.value)
    assert torchrig.ThroughputMonitor is ThroughputMonitor and torchrig.trainer.ThroughputMonitor is ThroughputMonitor


@pytest.mark.timeout(60)
def test_a_compiled_module_is_counted_on_its_first_batch_and_compiled_after(tmp_path: Path) -> None:
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monitor = ThroughputMonitor(peak_flops=1e12)
    logger = ListLogger()
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        compile={"backend": backend},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TwoLinear(), _loader(4))
    assert monitor.flops == (4 * IN * HIDDEN + 6 * HIDDEN * OUT) * BATCH
    assert graphs  # batches after the first ran compiled
    assert sorted(logger.rows_with("throughput/mfu")) == [2, 4]
    assert not [w for w in caught if "global hooks" in str(w.message)]
    torch._dynamo.reset()


class Clocked(TwoLinear):
    """Each training batch takes one second of a fake clock, each validation batch 100."""

    def __init__(self, clock: dict[str, float]) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.clock["now"] += 1.0
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.clock["now"] += 100.0


@pytest.mark.timeout(60)
def test_validation_inside_a_window_is_left_out_of_its_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"now": 0.0}
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    logger = ListLogger()
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=logger,
        callbacks=[ThroughputMonitor(flops_per_batch=1e6, peak_flops=1e12)],
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    # 3 batches per epoch: the validation after step 3 lies in the window from step 2 to step 4.
    trainer.fit(Clocked(clock), _loader(3), _loader(1))
    rows = logger.rows_with("throughput/samples_per_sec")
    assert sorted(rows) == [2, 4, 6]
    assert {s: r["throughput/samples_per_sec"] for s, r in rows.items()} == {2: BATCH, 4: BATCH, 6: BATCH}
    assert clock["now"] == 6 + 2 * 100  # both validations ran


class SideWork(torchrig.Callback):
    """After each training batch, 50 seconds of other work: 25 inside ``monitor.paused()``, and 25
    more inside it too (``pause``) or not."""

    def __init__(self, clock: dict[str, float], monitor: ThroughputMonitor, pause: bool) -> None:
        self.clock, self.monitor, self.pause = clock, monitor, pause

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with self.monitor.paused() if self.pause else contextlib.nullcontext():
            with self.monitor.paused():  # nested in the outer pause (when there is one): it holds
                self.clock["now"] += 25.0
            self.clock["now"] += 25.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pause", [True, False])
def test_time_inside_paused_is_left_out_of_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pause: bool
) -> None:
    clock = {"now": 0.0}
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    logger = ListLogger()
    monitor = ThroughputMonitor(flops_per_batch=1e6, peak_flops=1e12)
    with monitor.paused():  # outside a fit: nothing to leave out, and no error
        pass
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=logger,
        callbacks=[SideWork(clock, monitor, pause), monitor],
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Clocked(clock), _loader(4))
    rows = logger.rows_with("throughput/samples_per_sec")
    # The first batch starts the clock; then windows of 1 and 2 batches: 1 s of training a batch,
    # plus the 25 s of side work a batch that was not paused.
    side = 0.0 if pause else 25.0
    expected = {2: BATCH / (1 + side), 4: 2 * BATCH / (2 + 2 * side)}
    assert {s: r["throughput/samples_per_sec"] for s, r in rows.items()} == expected
    assert clock["now"] == 4 + 4 * 50
