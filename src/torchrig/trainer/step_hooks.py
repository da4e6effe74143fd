"""``StepHooks``: the module's overrides and the hooks around a training step and a batch's move
to the device, chosen once per epoch (or fit) so that what nobody overrides costs no call: the
part of a run's loops (:class:`~torchrig.trainer.loops.Run`) that Lightning's hooks add."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from torchrig.trainer.callbacks import overrides
from torchrig.trainer.module import TrainingModule
from torchrig.trainer.run import RunState


class StepHooks(RunState):
    """The step's overrides and hooks (a base of :class:`~torchrig.trainer.loops.Run`)."""

    def overridden_step(
        self,
        optimizers: list[Any],
        backward: Callable[..., Any],
        steps: list[Callable[..., Any]],
        zeros: list[Callable[..., Any]],
        clip: Callable[..., Any],
    ) -> tuple[Callable[..., Any], list[Callable[..., Any]], list[Callable[..., Any]], Callable[..., Any], bool]:
        """``backward``, the optimizers' steps and zero_grads and the clipping, each replaced by
        the module's override when it has one (``backward``, ``optimizer_step``,
        ``optimizer_zero_grad``, ``configure_gradient_clipping``), and whether clipping runs at
        every step (it does when overridden, as in Lightning)."""
        tr, module = self.trainer, self.require_module()
        state, precision = tr.fit_state, tr.rig.precision

        def own(name: str) -> bool:
            return overrides(module, TrainingModule, name)

        if own("backward"):

            def backward(loss: torch.Tensor, **kwargs: Any) -> None:
                module.backward(precision.scaled(loss), **kwargs)

        def closure() -> None:
            """What torchrig passes as ``optimizer_closure``: the batch's forward and backward ran already."""

        if own("optimizer_step"):
            steps = [partial(_stepper, module, state, o, closure) for o in optimizers]
        if own("optimizer_zero_grad"):
            zeros = [partial(_zeroer, module, state, o) for o in optimizers]
        if not own("configure_gradient_clipping"):
            return backward, steps, zeros, clip, False

        def configured_clip(prepared: Any, opts: list[Any]) -> None:
            for opt in opts:
                module.configure_gradient_clipping(opt, tr.gradient_clip_val, tr.gradient_clip_algorithm)

        return backward, steps, zeros, configured_clip, True

    def hooked_backward(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        """``backward`` with ``on_before_backward(loss)`` before it and ``on_after_backward()``
        after it, when a callback or the module overrides one (else ``backward`` itself)."""
        before, after = self.hooks("on_before_backward"), self.hooks("on_after_backward")
        if not (before or after):
            return backward

        def hooked(loss: torch.Tensor, **kwargs: Any) -> None:
            for hook in before:
                hook(loss)
            backward(loss, **kwargs)
            for hook in after:
                hook()

        return hooked

    def hooked_zero_grads(self, optimizers: list[Any], zeros: list[Callable[..., Any]]) -> list[Callable[..., Any]]:
        """Each optimizer's ``zero_grad``, after ``on_before_zero_grad(optimizer)`` when a
        callback or the module overrides it."""
        before = self.hooks("on_before_zero_grad")
        if not before:
            return zeros

        def hooked(optimizer: Any, zero_grad: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                for hook in before:
                    hook(optimizer)
                return zero_grad()

            return call

        return [hooked(o, z) for o, z in zip(optimizers, zeros, strict=True)]

    def hook_manual_steps(self) -> None:
        """Under manual optimization, ``optimizer.step()`` in ``training_step`` calls
        ``on_before_optimizer_step(optimizer)`` first (as Lightning's optimizers do), when a
        callback or the module overrides it; once per fit, on the optimizers prepared for it."""
        before = self.hooks("on_before_optimizer_step")
        if not before:
            return
        for optimizer in self.trainer.optimizers:
            step = optimizer.step

            def hooked(closure: Any = None, _opt: Any = optimizer, _step: Any = step) -> Any:
                for hook in before:
                    hook(_opt)
                return _step() if closure is None else _step(closure)

            optimizer.step = hooked  # type: ignore[method-assign]

    def transferred(self, batches: Any, dataloader_idx: int) -> Any:
        """``batches`` through the module's batch-transfer hooks, when it overrides one of them:
        ``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer``
        (the loader then leaves its batches where they are); else ``batches`` themselves."""
        hooks = self.transfer_hooks()
        if hooks is None:
            return batches
        return _transfer(batches, hooks, self.trainer.rig.device, dataloader_idx)


def _transfer(
    batches: Any, hooks: list[Callable[..., Any]], device: torch.device, dataloader_idx: int
) -> Iterator[Any]:
    before, move, after = hooks
    for batch in batches:
        yield after(move(before(batch, dataloader_idx), device, dataloader_idx), dataloader_idx)


def _stepper(module: TrainingModule, state: Any, optimizer: Any, closure: Callable[[], None]) -> None:
    module.optimizer_step(state.epoch, state.batch_idx, optimizer, closure)


def _zeroer(module: TrainingModule, state: Any, optimizer: Any) -> None:
    module.optimizer_zero_grad(state.epoch, state.batch_idx, optimizer)
