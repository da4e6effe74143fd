"""``ModelPruning``: prune parameters at epoch ends with ``torch.nn.utils.prune`` (Lightning's callback).

Each parameter to prune is put under ``torch.nn.utils.prune`` when the fit is set up, with an
all-ones mask (``prune.identity``), so the module holds ``<name>_orig`` and ``<name>_mask`` from
the first step: a checkpoint keeps every mask and a resumed fit loads them into the same form,
exactly. At each training epoch's end (or validation epoch's, ``prune_on_train_epoch_end=False``)
``amount`` more of the remaining entries are pruned, over all of them together
(``use_global_unstructured``) or parameter by parameter; with the lottery ticket hypothesis the
entries left are then reset to their values when the fit started (kept in checkpoints too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.utils import prune

from torchrig.trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer

#: ``pruning_fn`` names: the functions of ``torch.nn.utils.prune`` and their methods.
PRUNING_FUNCTIONS: dict[str, type[prune.BasePruningMethod]] = {
    "l1_unstructured": prune.L1Unstructured,
    "random_unstructured": prune.RandomUnstructured,
    "ln_structured": prune.LnStructured,
    "random_structured": prune.RandomStructured,
}

Amount = int | float | Callable[[int], int | float]


class ModelPruning(Callback):
    """Prune the module's parameters as it trains (Lightning's arguments).

    Args:
        pruning_fn: a name of :data:`PRUNING_FUNCTIONS` (``"l1_unstructured"``...) or a
            ``torch.nn.utils.prune.BasePruningMethod`` subclass.
        parameters_to_prune: ``(module, "name")`` pairs; empty: every ``parameter_names``
            parameter of every submodule.
        parameter_names: the names pruned when ``parameters_to_prune`` is empty (``weight``, ``bias``).
        use_global_unstructured: prune ``amount`` of all the entries together (unstructured methods
            only), rather than of each parameter.
        amount: the fraction (float) or number (int) of remaining entries pruned each time, or a
            function of the epoch giving it.
        apply_pruning: whether to prune, or a function of the epoch saying whether.
        make_pruning_permanent: when the fit ends, remove the reparametrization (``prune.remove``):
            plain parameters with the pruned entries at zero.
        use_lottery_ticket_hypothesis: after pruning, reset the entries left to their values when
            the fit started (or a function of the epoch saying whether).
        resample_parameters: with the lottery ticket hypothesis, reset them to new values drawn by
            each layer's ``reset_parameters()`` instead.
        pruning_dim: the dimension structured methods prune along.
        pruning_norm: the norm of ``ln_structured``.
        verbose: 1: print the overall sparsity after pruning; 2: and each parameter's.
        prune_on_train_epoch_end: prune at the training epoch's end; False: at the validation epoch's end.
    """

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(
        self,
        pruning_fn: Callable[..., Any] | str,
        parameters_to_prune: Sequence[tuple[nn.Module, str]] = (),
        parameter_names: list[str] | None = None,
        use_global_unstructured: bool = True,
        amount: Amount = 0.5,
        apply_pruning: bool | Callable[[int], bool] = True,
        make_pruning_permanent: bool = True,
        use_lottery_ticket_hypothesis: bool | Callable[[int], bool] = True,
        resample_parameters: bool = False,
        pruning_dim: int | None = None,
        pruning_norm: int | None = None,
        verbose: int = 0,
        prune_on_train_epoch_end: bool = True,
    ) -> None:
        self.method = _method_of(pruning_fn)
        self.parameter_names = list(parameter_names or self.PARAMETER_NAMES)
        for name in self.parameter_names:
            if name not in self.PARAMETER_NAMES:
                raise ValueError(f"ModelPruning(parameter_names=[..., {name!r}]): use 'weight' and/or 'bias'")
        kind = getattr(self.method, "PRUNING_TYPE", "unstructured")
        if use_global_unstructured and kind != "unstructured":
            raise ValueError(
                f"ModelPruning: use_global_unstructured=True prunes unstructured, but {self.method.__name__} is "
                f"{kind}; pass use_global_unstructured=False"
            )
        self.kwargs: dict[str, Any] = {}
        if kind == "structured":
            if pruning_dim is None:
                raise ValueError(f"ModelPruning: {self.method.__name__} is structured; give pruning_dim=")
            self.kwargs["dim"] = pruning_dim
        if self.method is prune.LnStructured:
            if pruning_norm is None:
                raise ValueError("ModelPruning: ln_structured needs the norm; give pruning_norm= (1, 2...)")
            self.kwargs["n"] = pruning_norm
        if not (
            callable(amount) or (isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount >= 0)
        ):
            raise TypeError(f"ModelPruning(amount={amount!r}): give a float fraction, an int count, or a function")
        if isinstance(amount, float) and amount > 1:
            raise ValueError(f"ModelPruning(amount={amount!r}): a float is a fraction in [0, 1]")
        if verbose not in (0, 1, 2):
            raise ValueError(f"ModelPruning(verbose={verbose!r}): use 0, 1 or 2")
        self.given = list(parameters_to_prune)
        self.use_global_unstructured = use_global_unstructured
        self.amount, self.apply_pruning = amount, apply_pruning
        self.make_pruning_permanent = make_pruning_permanent
        self.use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self.resample_parameters = resample_parameters
        self.verbose, self.prune_on_train_epoch_end = verbose, prune_on_train_epoch_end
        self.pairs: list[tuple[nn.Module, str]] = []
        #: The values the pruned parameters had when the fit started (lottery ticket hypothesis).
        self.originals = nn.Module()

    # -- set-up --------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "fit":
            return
        self.pairs = self._pairs(module)
        self.originals = nn.Module()
        for i, (layer, name) in enumerate(self.pairs):
            if not prune.is_pruned(layer) or not hasattr(layer, f"{name}_mask"):
                prune.identity(layer, name)  # an all-ones mask: the checkpoint's form from the start
            self.originals.register_buffer(f"p{i}", getattr(layer, f"{name}_orig").detach().clone())

    def _pairs(self, module: TrainingModule) -> list[tuple[nn.Module, str]]:
        mine = list(module.modules())
        if not self.given:
            return [
                (m, name)
                for name in self.parameter_names
                for m in mine
                if isinstance(m._parameters.get(name), nn.Parameter) or hasattr(m, f"{name}_orig")
            ]
        for layer, name in self.given:
            if not any(layer is m for m in mine):
                raise ValueError(
                    f"ModelPruning(parameters_to_prune=[({type(layer).__name__}, {name!r}), ...]): that module is not "
                    f"part of {type(module).__name__}; give submodules of the module being fit"
                )
            if not hasattr(layer, name):
                raise ValueError(
                    f"ModelPruning(parameters_to_prune=[({type(layer).__name__}, {name!r}), ...]): "
                    f"{type(layer).__name__} has no parameter {name!r}"
                )
        return list(self.given)

    # -- pruning ------------------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.prune_on_train_epoch_end:
            self.run_pruning(trainer, trainer.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self.prune_on_train_epoch_end and not trainer.sanity_checking:
            self.run_pruning(trainer, trainer.current_epoch)

    def run_pruning(self, trainer: Trainer, epoch: int) -> None:
        """Prune as configured for ``epoch`` (Lightning's ``_run_pruning``)."""
        due = self.apply_pruning(epoch) if callable(self.apply_pruning) else self.apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not due or not amount:
            return
        with torch.no_grad():
            for layer, name in self.pairs:  # rank today's weights, not those of the last forward
                setattr(layer, name, getattr(layer, f"{name}_orig") * getattr(layer, f"{name}_mask"))
            if self.use_global_unstructured:
                prune.global_unstructured(self.pairs, pruning_method=self.method, amount=amount, **self.kwargs)
            else:
                for layer, name in self.pairs:
                    self.method.apply(layer, name, amount=amount, **self.kwargs)
            lottery = self.use_lottery_ticket_hypothesis
            if lottery(epoch) if callable(lottery) else lottery:
                self._reset_to_originals()
        if self.verbose:
            self._report(trainer)

    def _reset_to_originals(self) -> None:
        start = dict(self.originals.named_buffers())
        layers: dict[int, nn.Module] = {}
        for i, (layer, name) in enumerate(self.pairs):
            value = start[f"p{i}"]
            if self.resample_parameters and callable(getattr(layer, "reset_parameters", None)):
                fresh = layers.get(id(layer))
                if fresh is None:
                    fresh = layers[id(layer)] = copy.deepcopy(layer)
                    for n in self.PARAMETER_NAMES:  # plain parameters again, for reset_parameters
                        if hasattr(fresh, f"{n}_orig"):
                            prune.remove(fresh, n)
                    fresh.reset_parameters()  # type: ignore[operator]
                value = getattr(fresh, name)
            getattr(layer, f"{name}_orig").copy_(value)

    def _report(self, trainer: Trainer) -> None:
        zeros = [int((getattr(layer, f"{name}_mask") == 0).sum()) for layer, name in self.pairs]
        sizes = [getattr(layer, f"{name}_mask").numel() for layer, name in self.pairs]
        lines = [f"torchrig: ModelPruning: {sum(zeros)}/{sum(sizes)} ({sum(zeros) / max(sum(sizes), 1):.2%}) pruned"]
        if self.verbose == 2:
            for (layer, name), z, n in zip(self.pairs, zeros, sizes, strict=True):
                lines.append(f"  {type(layer).__name__}.{name}: {z}/{n} ({z / max(n, 1):.2%})")
        trainer.rig.print("\n".join(lines))

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.make_pruning_permanent:
            for layer, name in self.pairs:
                prune.remove(layer, name)

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_modules(self, trainer: Trainer) -> dict[str, nn.Module]:
        return {"originals": self.originals}  # the masks are the module's own buffers


def _method_of(fn: Any) -> type[prune.BasePruningMethod]:
    if isinstance(fn, str):
        method = PRUNING_FUNCTIONS.get(fn.lower())
        if method is None:
            raise ValueError(
                f"ModelPruning(pruning_fn={fn!r}): use one of {', '.join(map(repr, PRUNING_FUNCTIONS))}, "
                "or a torch.nn.utils.prune.BasePruningMethod subclass"
            )
        return method
    if isinstance(fn, type) and issubclass(fn, prune.BasePruningMethod):
        return fn
    named = PRUNING_FUNCTIONS.get(getattr(fn, "__name__", ""))
    if named is not None and getattr(prune, fn.__name__, None) is fn:  # prune.l1_unstructured itself
        return named
    raise TypeError(
        f"ModelPruning(pruning_fn={fn!r}): give a name ({', '.join(map(repr, PRUNING_FUNCTIONS))}) or a "
        "torch.nn.utils.prune.BasePruningMethod subclass"
    )
