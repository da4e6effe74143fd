"""``SpikeDetection``: stop on (or skip) a training loss far above its running mean (Lightning's callback).

A loss is a spike when, ``warmup`` batches into the epoch, it is not an improvement on the last
loss kept (``mode``: lower is better for ``"min"``) and it differs from the mean of the last
``window`` losses kept by at least ``atol`` (when given) and by at least ``rtol`` times that mean
(when given); with ``finite_only`` a loss that is not finite is a spike too. Losses that are
not spikes are kept.

On a spike the batch and the one before it are added to ``bad_batches`` and written, as a JSON
list, to ``exclude_batches_path`` (rank 0); then, with ``on_spike="raise"`` (Lightning's
behaviour) :class:`TrainingSpikeException` stops the fit; with ``on_spike="skip"`` (torchrig's)
the batch's optimizer step is skipped (its gradients are dropped before the step, so no
parameter and no optimizer state changes) and the fit goes on.

Host reads: the loss and the statistics stay on the device; the decision, which changes what
runs next, is one read on the host per batch (two booleans: spike, finite), plus, with several
processes, all-reduces so every process decides alike. Only fits that use the callback pay it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchrig import arguments
from torchrig.trainer.callbacks import Callback, EventSchedule
from torchrig.trainer.step_runner import loss_of

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


class TrainingSpikeException(RuntimeError):  # noqa: N818 (Lightning's name)
    """Raised by :class:`SpikeDetection` (``on_spike="raise"``) at a loss spike."""

    def __init__(self, batch_idx: int) -> None:
        super().__init__(f"Training spike detected in batch {batch_idx}")
        self.batch_idx = batch_idx


class SpikeDetection(Callback):
    """Watch the training loss for spikes (Lightning's arguments, see the module docstring).

    Args:
        mode: ``"min"`` (a lower loss is better) or ``"max"``.
        window: how many of the last losses kept the running mean is taken over.
        warmup: the first batch of each epoch checked (the batch index, as in Lightning).
        atol: the least absolute distance from the running mean that is a spike (None: any).
        rtol: the least distance, as a multiple of the running mean, that is a spike (None: any).
        exclude_batches_path: the JSON file of the batches to exclude (a directory gets
            ``skip_batches.json``); default ``<default_root_dir>/skip_batches.json``.
        finite_only: a loss that is not finite (NaN, inf) is a spike.
        on_spike: ``"raise"``: raise :class:`TrainingSpikeException` (Lightning); ``"skip"``:
            skip the batch's optimizer step and go on (with ``accumulate_grad_batches=1``).
    """

    def __init__(
        self,
        mode: str = "min",
        window: int = 10,
        warmup: int = 1,
        atol: float | None = None,
        rtol: float | None = 2.0,
        exclude_batches_path: str | os.PathLike[str] | None = None,
        finite_only: bool = True,
        on_spike: str = "raise",
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"SpikeDetection(mode={mode!r}); use 'min' or 'max'")
        if on_spike not in ("raise", "skip"):
            raise ValueError(f"SpikeDetection(on_spike={on_spike!r}); use 'raise' (stop the fit) or 'skip' (its step)")
        for name, tol in (("atol", atol), ("rtol", rtol)):
            if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))):
                raise TypeError(f"SpikeDetection({name}={tol!r}) must be a number or None")
        self.mode, self.on_spike = mode, on_spike
        self.window = arguments.int_in_range("window", window, 1)
        self.warmup = arguments.int_in_range("warmup", warmup, 0)
        self.atol, self.rtol, self.finite_only = atol, rtol, bool(finite_only)
        self.exclude_batches_path = exclude_batches_path
        #: The batch indices excluded so far (each spike adds its batch and the one before).
        self.bad_batches: list[int] = []
        self.kept = 0  # losses kept so far (the window holds the last min(kept, window))
        self.values = torch.zeros(window, dtype=torch.float64)
        self.last_val = torch.zeros((), dtype=torch.float64)
        self._loss: torch.Tensor | None = None
        self._batch_idx = 0

    def event_schedule(self, event: str) -> EventSchedule:
        if event in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step"):
            return EventSchedule(enabled=self.on_spike == "skip")
        if event == "on_train_batch_end":
            return EventSchedule(enabled=self.on_spike == "raise")
        return EventSchedule()

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.on_spike == "skip" and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "SpikeDetection(on_spike='skip') skips one batch's optimizer step, but accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} steps once for several batches; use on_spike='raise' or "
                "accumulate_grad_batches=1"
            )
        device = trainer.rig.device
        self.values, self.last_val = self.values.to(device), self.last_val.to(device)

    # -- "raise": after the batch, as Lightning ------------------------------------------------------
    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = None if isinstance(outputs, dict) and "loss" not in outputs else loss_of(outputs)
        if loss is not None and self.check(trainer, loss.detach(), batch_idx):
            raise TrainingSpikeException(batch_idx)

    # -- "skip": before the optimizer step -----------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: Trainer, module: TrainingModule, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Any) -> None:
        loss, self._loss = self._loss, None
        if loss is not None and self.check(trainer, loss, self._batch_idx):
            optimizer.zero_grad(set_to_none=True)  # torch's optimizers skip parameters without gradients
            trainer.rig.print(f"torchrig: SpikeDetection: loss spike in batch {self._batch_idx}; its step skipped")

    # -- the decision --------------------------------------------------------------------------------
    def check(self, trainer: Trainer, loss: torch.Tensor, batch_idx: int) -> bool:
        """Whether ``loss`` (of batch ``batch_idx``) is a spike, agreed by every process; keeps it
        when it is not, records the batches to exclude when it is."""
        loss = loss.to(torch.float64)
        spike_now, finite = torch.stack([self._is_spike(loss), torch.isfinite(loss)]).tolist()  # the one host read
        spike = batch_idx >= self.warmup and spike_now
        if trainer.world_size > 1:
            spike = trainer.rig.reduce_boolean_decision(spike, all=False)
        if spike:
            self.bad_batches.extend([batch_idx - 1, batch_idx])
            self._write(trainer)
        elif trainer.rig.reduce_boolean_decision(finite, all=True) if trainer.world_size > 1 else finite:
            self.values[self.kept % self.window] = loss
            self.kept += 1
            self.last_val = loss
        return spike

    def _is_spike(self, loss: torch.Tensor) -> torch.Tensor:
        """The rule of the module docstring as one device tensor (no host read)."""
        diff = loss - self.last_val
        better = diff <= 0 if self.mode == "min" else diff >= 0
        if self.kept == 0:  # no running mean yet: nothing to compare with
            far = torch.zeros((), dtype=torch.bool, device=loss.device)
        else:
            mean = self.values[: min(self.kept, self.window)].mean()
            distance = (loss - mean).abs()
            far = torch.ones((), dtype=torch.bool, device=loss.device)
            if self.atol is not None:
                far = far & (distance >= abs(self.atol))
            if self.rtol is not None:
                far = far & (distance >= (self.rtol * mean).abs())
        spike = ~better & far
        if self.finite_only:
            spike = spike | ~torch.isfinite(loss)
        return spike

    def _write(self, trainer: Trainer) -> None:
        path = Path(self.exclude_batches_path or trainer.default_root_dir)
        if path.suffix != ".json":
            path = path / "skip_batches.json"
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.bad_batches, indent=4))

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "bad_batches": list(self.bad_batches),
            "kept": self.kept,
            "values": self.values.cpu().tolist(),
            "last_val": float(self.last_val),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_batches = [int(b) for b in state.get("bad_batches", [])]
        self.kept = int(state.get("kept", 0))
        device = self.values.device
        self.values = torch.tensor(state.get("values", [0.0] * self.window), dtype=torch.float64, device=device)
        self.last_val = torch.tensor(float(state.get("last_val", 0.0)), dtype=torch.float64, device=device)
