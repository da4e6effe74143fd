"""``ThroughputMonitor``: samples/s, items/s, achieved TFLOP/s and MFU of a fit, through the loggers.

How it measures, and what each number means:

* **Timing windows.** The clock (``time.perf_counter``) is read on the host at logging steps
  only (every ``log_every_n_steps`` optimizer steps), never per batch, and nothing waits for the
  device: a logged value is the work of the batches since the last logging step over the host
  seconds between the two. So a window spans several steps. The host cannot run more than a few
  steps ahead of the device (the Trainer's own logging reads values at the same steps, and the
  allocator and the launch queue hold it back), so over a window of many steps host time is the
  device's; with ``log_every_n_steps=1`` on an accelerator the numbers are noisy. Validation run
  inside a window is left out of its time; data loading, checkpointing and anything else between
  two logging steps is in it.
* **The first training batch of each fit is not counted**: it starts the clock. It is the batch
  whose FLOPs are counted (see below) and often holds one-off work (the first CUDA kernels, the
  loader's workers starting). A ``compile=`` model runs that batch eager (the FLOP counter is a
  dispatch mode, under which ``torch.compile`` does not trace) and compiles at its second batch,
  so the first logged window of a compiled run includes the compilation; the later ones do not.
* **FLOPs per batch** (one ``training_step`` on one device, forward and backward) are counted
  once, on the first training batch, with :class:`torch.utils.flop_counter.FlopCounterMode`,
  or given as ``flops_per_batch=``. The counter counts matrix multiplications, convolutions and
  attention (what dominates a model's FLOPs), not element-wise operations nor the optimizer
  step. Attention counts as full (non-causal) matrix products, as the usual MFU formulas do. An
  input that does not require a gradient gets none: a first ``Linear`` layer costs
  ``4 x params x samples``, a later one ``6 x params x samples``.
* **MFU** is achieved FLOP/s per device over the device's peak: ``peak_flops=`` (FLOP/s, one
  device) or, on the devices in :data:`PEAK_TFLOPS`, their dense bf16 tensor-core peak. On any
  other device MFU is not logged (a warning says so once) but TFLOP/s still is. The peak is the
  bf16 one whatever the precision of the run, as MFU is usually quoted.
* **Samples** per batch are the length of the first tensor found in the batch (its first
  dimension, host metadata: no sync). **Items** (tokens, say) are counted when
  ``training_step`` returns ``{"loss": loss_sum, "num_items": n}`` (the Trainer's token-weighted
  form; ``n`` a number or a tensor, a tensor summed on the device and read once per logging step).
* **Under data parallelism** every rank trains a batch of the same size, so the global samples/s
  is this rank's times the data-parallel ranks (the world size, less the pipeline stages and
  tensor-parallel peers that share a batch); ``.../samples_per_sec_per_device`` is this rank's.
  Item counts differ between ranks (padding), so the global items/s sums them across ranks (and
  divides out the peers sharing a batch): one all-reduce per logging step, on every rank. Under
  pipeline parallel the FLOPs counted on the first batch are this rank's stages'.

Logged names: ``throughput/samples_per_sec``, ``throughput/samples_per_sec_per_device``,
``throughput/items_per_sec``, ``throughput/items_per_sec_per_device``,
``throughput/tflops_per_device`` and ``throughput/mfu`` (a fraction, 0.4 = 40%).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

#: Dense (no sparsity) bf16 tensor-core peak, TFLOP/s per device, by a pattern of the name
#: ``torch.cuda.get_device_name`` gives. From the vendors' datasheets: NVIDIA A100 Tensor Core GPU
#: datasheet (312; SXM and PCIe alike), NVIDIA H100 Tensor Core GPU datasheet (H100 SXM 989; the
#: PCIe and NVL cards are slower and not matched), NVIDIA H200 Tensor Core GPU datasheet (H200 SXM
#: 989; H200 NVL not matched), NVIDIA HGX/DGX B200 datasheet (B200 2,250 dense), AMD Instinct
#: MI300X data sheet (1,307.4). The datasheets quote the sparse figure too (twice these).
PEAK_TFLOPS: dict[str, float] = {
    r"\bA100\b": 312.0,
    r"\bH100\b(?!.*\b(PCIe|NVL)\b)": 989.0,
    r"\bH200\b(?!.*\bNVL\b)": 989.0,
    r"\bB200\b": 2250.0,
    r"\bMI300X\b": 1307.4,
}


def device_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the device named ``device_name`` (as
    ``torch.cuda.get_device_name`` spells it), or None for a device not in :data:`PEAK_TFLOPS`."""
    for pattern, tflops in PEAK_TFLOPS.items():
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops * 1e12
    return None


def measure_flops(step: Callable[[], Any]) -> int:
    """The FLOPs ``step()`` runs (matrix products, convolutions, attention), counted with
    :class:`~torch.utils.flop_counter.FlopCounterMode`. ``step`` should run a forward and a
    backward pass, as in training. Works on ``meta`` tensors too (no memory, no compute):

    >>> model = torch.nn.Linear(1024, 1024, bias=False, device="meta")
    >>> x = torch.randn(8, 1024, device="meta", requires_grad=True)
    >>> measure_flops(lambda: model(x).sum().backward()) == 6 * 1024 * 1024 * 8
    True

    Under ``torch.compile`` the step runs eager while counting (compiled code is not counted,
    and compiling under the counter would stop the code from ever compiling).
    """
    counter = FlopCounterMode(display=False)
    with torch.compiler.set_stance("force_eager"), counter, warnings.catch_warnings():
        # The counter's module hooks are global; torch.compile(module) warns of them, needlessly here.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        step()
    return int(counter.get_total_flops())


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"ThroughputMonitor({name}={value!r}): give a positive finite number, or None")
    return float(value)


def _samples_in(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (depth first), or None."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = _samples_in(item)
            if n is not None:
                return n
    return None


class ThroughputMonitor(Callback):
    """Logs samples/s, items/s, achieved TFLOP/s and MFU every ``log_every_n_steps`` steps.

    See the module docstring (and docs/trainer_tools.md) for what each value means and how it is
    timed. No host-device sync per step: counts and timestamps are kept on the host and read at
    logging steps.

    Args:
        flops_per_batch: forward+backward FLOPs of one ``training_step`` on one device; None
            (default): counted on the first training batch.
        peak_flops: the peak FLOP/s of one device, for MFU; None (default): from
            :data:`PEAK_TFLOPS` by the CUDA device's name (no MFU on other devices).

    Example:
        >>> # Trainer(callbacks=[ThroughputMonitor()], log_every_n_steps=20)
        >>> # Trainer(callbacks=[ThroughputMonitor(peak_flops=989e12)])  # an H100 SXM
    """

    def __init__(self, *, flops_per_batch: float | None = None, peak_flops: float | None = None) -> None:
        self.flops_per_batch = _positive("flops_per_batch", flops_per_batch)
        self.peak_flops = _positive("peak_flops", peak_flops)
        self.last_values: dict[str, float] = {}
        self._peak: float | None = self.peak_flops
        self._warned = False
        self._measured: float | None = None  # FLOPs counted on a first batch
        self._counting: tuple[Any, FlopCounterMode] | None = None  # (stance, counter) while counting
        self._started = False  # the fit's first batch has ended (the clock runs)
        self._t0 = 0.0
        self._paused_at: float | None = None
        self._batches = 0
        self._samples = 0
        self._no_samples = False
        self._items: int | torch.Tensor | None = None
        self._last_step = -1

    @property
    def flops(self) -> float | None:
        """The FLOPs per batch in use: ``flops_per_batch`` or the counted ones (None before)."""
        return self.flops_per_batch if self.flops_per_batch is not None else self._measured

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._started, self._last_step, self._paused_at = False, -1, None
        self._reset_window(0.0)
        if self.peak_flops is None:
            device = trainer.rig.device
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            self._peak = device_peak_flops(name)
            if self._peak is None and not self._warned:
                self._warned = True
                warnings.warn(
                    f"ThroughputMonitor: no known peak FLOP/s for device {name!r}, so MFU is not logged "
                    "(TFLOP/s is); pass peak_flops= (FLOP/s of one device) to log it",
                    stacklevel=2,
                )

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self._started and self.flops is None and self._counting is None:
            stance = torch.compiler.set_stance("force_eager")  # set now, put back by __exit__
            counter = FlopCounterMode(display=False)
            counter.__enter__()
            self._counting = (stance, counter)

    def _stop_counting(self) -> None:
        if self._counting is not None:
            stance, counter = self._counting
            self._counting = None
            counter.__exit__(None, None, None)
            stance.__exit__(None, None, None)
            self._measured = float(counter.get_total_flops())

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._started:  # the fit's first batch: it starts the clock, uncounted
            self._stop_counting()
            self._started = True
            self._last_step = trainer.global_step
            self._reset_window(time.perf_counter())
            return
        self._batches += 1
        if not self._no_samples:
            n = _samples_in(batch)
            if n is None:
                self._no_samples = True
                warnings.warn(
                    f"ThroughputMonitor: no tensor in the batch ({type(batch).__name__}) to count samples "
                    "by; samples/s is not logged",
                    stacklevel=2,
                )
            else:
                self._samples += n
        if isinstance(outputs, dict) and "num_items" in outputs:
            items = outputs["num_items"]
            if isinstance(items, torch.Tensor):
                items = items.detach()
            self._items = items if self._items is None else self._items + items
        step = trainer.global_step
        if step != self._last_step and step % trainer.log_every_n_steps == 0:
            self._last_step = step
            self._log(trainer)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leaves the time spent inside out of the current window, as evaluation is left out.

        For work a callback does between training steps that is not training (sampling text,
        another model's steps): ``with monitor.paused(): ...``. Nested or outside a fit, it does
        nothing more.
        """
        mine = self._pause()
        try:
            yield
        finally:
            if mine:
                self._resume()

    def _pause(self) -> bool:
        if not self._started or self._paused_at is not None:
            return False
        self._paused_at = time.perf_counter()
        return True

    def _resume(self) -> None:
        if self._paused_at is not None:
            self._t0 += time.perf_counter() - self._paused_at  # the window leaves the pause out
            self._paused_at = None

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._pause()

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._resume()

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._stop_counting()  # an epoch without batches

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._stop_counting()

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._stop_counting()

    def _reset_window(self, now: float) -> None:
        self._t0, self._batches, self._samples, self._items = now, 0, 0, None

    def _log(self, trainer: Trainer) -> None:
        now = time.perf_counter()
        seconds = now - self._t0
        world = trainer.world_size
        replicas = trainer.rig.strategy.data_parallel_size  # pipeline stages, tensor-parallel peers share batches
        values: dict[str, float] = {}
        if seconds > 0 and self._batches:
            if not self._no_samples:
                values["throughput/samples_per_sec"] = self._samples * replicas / seconds
                values["throughput/samples_per_sec_per_device"] = self._samples / seconds
            if self._items is not None:
                items = self._items
                local = float(items.item() if isinstance(items, torch.Tensor) else items)
                total = local
                if world > 1:
                    device = trainer.rig.device
                    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
                    count = torch.tensor(local, dtype=dtype, device=device)
                    total = float(trainer.rig.all_reduce(count, op="sum").item()) * replicas / world
                values["throughput/items_per_sec"] = total / seconds
                values["throughput/items_per_sec_per_device"] = local / seconds
            flops = self.flops
            if flops is not None:
                achieved = flops * self._batches / seconds
                values["throughput/tflops_per_device"] = achieved / 1e12
                if self._peak is not None:
                    values["throughput/mfu"] = achieved / self._peak
        self._reset_window(now)
        if values:
            self.last_values = values
            for lg in trainer.loggers:
                lg.log_metrics(dict(values), step=trainer.global_step)
