"""``EMA``: an exponential moving average of the weights, for validation and in checkpoints.

After every optimizer step the average moves towards the weights:
``average = decay * average + (1 - decay) * weights`` (``torch._foreach_lerp_``, on the
device: no host sync). Validation during the fit runs on the averaged weights (they are
swapped in for it and the trained weights put back after, bitwise); the average is saved in
every checkpoint the Trainer writes and restored on resume.

With ``swa_start=N`` the average becomes stochastic weight averaging from step ``N`` on: the
equal-weight mean of the weights after each optimizer step since then.

Under FSDP the parameters are ``DTensor`` shards: each process averages its own shards and the
checkpoint stores them as DCP shards like the module's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchrig import arguments
from torchrig.dtensors import is_dtensor
from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

#: The name of the averaged weights in a checkpoint: the entry ``EMA.averaged``.
ENTRY = "averaged"


class EMA(Callback):
    """Keep an exponential moving average of the module's weights; validate with it; save it.

    Args:
        decay: the weight of the past, in ``[0, 1)``: ``average = decay * average + (1 - decay) * weights``
            after every optimizer step (the average starts as the weights when the fit starts).
        swa_start: from this optimizer step on (counted as ``trainer.global_step``), average with
            equal weights instead (stochastic weight averaging: the mean of the weights after each
            step since then). ``None``: never.

    Averaged: every floating-point parameter and buffer of the module (BatchNorm's running
    statistics too); integer buffers are left as they are. Only the weights are averaged: the
    learning rate schedule and BatchNorm statistics are not recomputed for SWA.

    The average lives in :attr:`averaged` (a module of buffers named as the module's state-dict
    keys) and in checkpoints as the entry ``EMA.averaged``; :meth:`copy_to` writes it into the
    module (before testing or exporting it). Validation in a fit runs on the average;
    ``trainer.test``/``predict``/``validate`` afterwards run on whatever the module holds.

    Example:
        >>> # ema = torchrig.EMA(decay=0.999)
        >>> # trainer = torchrig.Trainer(callbacks=[ema]); trainer.fit(module, train, val)
        >>> # ema.copy_to(module); trainer.test(module, test_loader)
    """

    def __init__(self, decay: float = 0.999, *, swa_start: int | None = None) -> None:
        self.decay = arguments.finite_at_least("decay", decay, 0.0)
        if self.decay >= 1.0:
            raise ValueError(f"decay={decay!r} must be in [0, 1): the average would never move")
        self.swa_start = None if swa_start is None else arguments.int_in_range("swa_start", swa_start, 0)
        #: The averaged tensors (buffers named as the module's state-dict keys); None before a fit.
        self.averaged: nn.Module | None = None
        self._module: nn.Module | None = None  # the module ``averaged`` belongs to
        self._live: list[torch.Tensor] = []
        self._shadow: list[torch.Tensor] = []
        self._sharded = False
        self._backup: list[torch.Tensor] | None = None
        self.updates = 0  # optimizer steps averaged so far
        self.swa_updates = 0  # of those, steps averaged with equal weights
        self._last_step = -1

    # -- the average ---------------------------------------------------------------------
    def _attach(self, module: nn.Module, fresh: bool = False) -> None:
        """Start averaging ``module``'s current tensors (unless already attached to it and not ``fresh``)."""
        if self._module is module and self.averaged is not None and not fresh:
            return
        averaged = nn.Module()
        live: list[torch.Tensor] = []
        shadow: list[torch.Tensor] = []
        tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
        tensors.update(module.named_buffers())
        for name, t in tensors.items():
            if not t.is_floating_point():
                continue
            copy = t.detach().clone()
            _register(averaged, name, copy)
            live.append(t)
            shadow.append(copy)
        self.averaged, self._module, self._live, self._shadow = averaged, module, live, shadow
        self._sharded = any(is_dtensor(t) for t in live)
        self.updates = self.swa_updates = 0
        self._last_step = -1

    def _locals(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The live and averaged tensors as plain tensors (each process's shards under FSDP)."""
        if not self._sharded:
            return self._live, self._shadow
        return [_local(t) for t in self._live], [_local(t) for t in self._shadow]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Average in the module's current weights (the Trainer calls this after each optimizer step)."""
        live, shadow = self._locals()
        if self.swa_start is not None and step >= self.swa_start:
            self.swa_updates += 1
            weight = 1.0 / self.swa_updates  # the running mean: the first SWA step takes the weights
        else:
            weight = 1.0 - self.decay
        torch._foreach_lerp_(shadow, live, weight)
        self.updates += 1

    @torch.no_grad()
    def copy_to(self, module: TrainingModule | None = None) -> None:
        """Write the averaged weights into the module (the one fitted; ``module`` must be it)."""
        if self.averaged is None or self._module is None:
            raise RuntimeError(
                "EMA.copy_to(): there is no average yet; fit with the EMA callback first (under strategy="
                "'ddp_spawn' the average stays in the started processes: save a checkpoint there)"
            )
        if module is not None and module is not self._module:
            raise ValueError(
                f"EMA.copy_to() got a {type(module).__name__} other than the module this EMA averaged; "
                "pass the module that was fitted (or nothing)"
            )
        live, shadow = self._locals()
        torch._foreach_copy_(live, shadow)

    # -- Trainer events --------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # A resumed fit has attached and loaded the average already; any other fit starts one.
        self._attach(module, fresh=not trainer.run.resumed)
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step  # the batch end of an accumulation micro-batch took no step
        if step != self._last_step:
            self._last_step = step
            self.update(step)

    def on_eval_start(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if trainer.run.stage != "fit" or self._backup is not None:
            return
        with torch.no_grad():
            live, shadow = self._locals()
            self._backup = [t.clone() for t in live]
            torch._foreach_copy_(live, shadow)

    def on_eval_end(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._restore()  # a validation that raised left the average in the module

    def _restore(self) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            live, _ = self._locals()
            torch._foreach_copy_(live, self._backup)
        self._backup = None

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoint_modules(self, trainer: Trainer) -> dict[str, nn.Module]:
        self._attach(trainer.run.require_module())
        assert self.averaged is not None
        return {ENTRY: self.averaged}

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "swa_start": self.swa_start,
            "updates": self.updates,
            "swa_updates": self.swa_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state.get("updates", 0))
        self.swa_updates = int(state.get("swa_updates", 0))

    def __repr__(self) -> str:
        swa = "" if self.swa_start is None else f", swa_start={self.swa_start}"
        return f"EMA(decay={self.decay}{swa})"


def _register(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` as the buffer ``name`` (``"net.0.weight"``) of ``root``, with the submodules
    on the way, so the averaged module's state-dict keys are the module's own."""
    *path, leaf = name.split(".")
    node = root
    for part in path:
        child = getattr(node, part, None) if part in node._modules else None
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.register_buffer(leaf, tensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]
