"""Lightning's tuning callbacks: :class:`BatchSizeFinder` and :class:`LearningRateFinder` run
:func:`torchrig.tune.scale_batch_size`'s search and :func:`torchrig.tune.lr_find`'s sweep at
the start of a fit, on the fit's own prepared module, optimizer and data.

After the search the fit's loaders (batch size) or optimizers (learning rate) are made again
from the value found, so the fit trains as one given that value directly: the weights, the
optimizer's state and the RNG are put back first. What was found is the callback's state in
checkpoints: a resumed fit uses it again and searches nothing.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torchrig.checkpoint.rng import capture_rng, restore_rng
from torchrig.trainer import stages
from torchrig.trainer.callbacks import Callback
from torchrig.tune.batch_size import Search, find_batch_size
from torchrig.tune.lr_finder import LRFinderResult, Sweep, check_args, run_sweep
from torchrig.tune.sweep import Attribute, holders, one_optimizer

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule
    from torchrig.trainer.trainer import Trainer


class BatchSizeFinder(Callback):
    """Find the largest batch size that trains when the fit starts (Lightning's callback).

    Takes :func:`torchrig.tune.scale_batch_size`'s arguments. At ``on_fit_start`` it searches
    on the fit's module and optimizer, sets ``batch_arg_name`` on the module (or its hparams,
    or the datamodule) to the size found (:attr:`optimal_batch_size`), and asks
    ``train_dataloader()`` and ``val_dataloader()`` again, so the fit runs as one started with
    that batch size: loaders, shuffle seed, ``configure_optimizers()`` (a schedule sized by
    ``trainer.estimated_stepping_batches``) and RNG alike.

    At the start of ``validate``, ``test`` and ``predict`` (Lightning's too) it searches with
    that stage's step (no gradients) and asks the stage's ``*_dataloader()`` again.

    The loaders must come from the module's or datamodule's loader methods (a DataLoader given
    to ``fit``, ``test``... is built already and is refused, as in Lightning). One process.
    """

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        mode = mode.lower() if isinstance(mode, str) else mode
        self.search = Search(mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin, max_val)
        #: The batch size found (``init_val`` until a search ran, as in Lightning).
        self.optimal_batch_size: int = init_val
        self.found = False

    def scale_batch_size(self, trainer: Trainer, module: TrainingModule) -> None:
        """Search now (Lightning's method; ``on_fit_start`` calls it)."""
        who = "BatchSizeFinder"
        if trainer.run.train_given:
            raise ValueError(
                f"{who} asks train_dataloader() for loaders of each batch size it tries, but this fit was given "
                "its DataLoader: return it from the module's (or a datamodule's) train_dataloader() instead, "
                "built with the batch size attribute"
            )
        prepared = trainer.run.prepared_module
        optimizer = one_optimizer(who, module, trainer.optimizers)
        rng = capture_rng(trainer.rig.device)
        try:
            size = find_batch_size(trainer, who, prepared, optimizer, trainer.run.datamodule, self.search)
        finally:
            restore_rng(rng, trainer.rig.device)
        self.optimal_batch_size, self.found = size, True
        stages.remake_fit_setup(trainer, loaders=True, optimizers=True)

    def scale_eval_batch_size(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Search for a ``validate``/``test``/``predict`` run (its step, no gradients), then ask
        the stage's ``*_dataloader()`` again."""
        who = "BatchSizeFinder"
        if _skipped_for_fast_dev_run(trainer, who):
            return
        if trainer.run.eval_given:
            raise ValueError(
                f"{who} asks the {stage} loader method for loaders of each batch size it tries, but this run was "
                "given its DataLoader: return it from the module's (or a datamodule's) loader method instead"
            )
        rng = capture_rng(trainer.rig.device)
        try:
            prepared, datamodule = trainer.run.prepared_module, trainer.run.datamodule
            size = find_batch_size(trainer, who, prepared, None, datamodule, self.search, stage)
        finally:
            restore_rng(rng, trainer.rig.device)
        self.optimal_batch_size, self.found = size, True
        stages.remake_eval_loaders(trainer, stage)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.run.stage == "validate" and not trainer.sanity_checking:  # not a fit's validation
            self.scale_eval_batch_size(trainer, module, "validate")

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.scale_eval_batch_size(trainer, module, "test")

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.scale_eval_batch_size(trainer, module, "predict")

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _skipped_for_fast_dev_run(trainer, "BatchSizeFinder"):
            return
        if trainer.run.resumed and self.found:  # the size the interrupted fit found
            name, datamodule = self.search.batch_arg_name, trainer.run.datamodule
            Attribute("BatchSizeFinder", "batch_arg_name", name, module, datamodule).set(self.optimal_batch_size)
            stages.remake_fit_setup(trainer, loaders=True, optimizers=False)
            return
        self.scale_batch_size(trainer, module)

    def state_dict(self) -> dict[str, Any]:
        return {"optimal_batch_size": self.optimal_batch_size, "found": self.found}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimal_batch_size = int(state.get("optimal_batch_size", self.optimal_batch_size))
        self.found = bool(state.get("found", False))


class LearningRateFinder(Callback):
    """Sweep the learning rate when the fit starts and train with the suggestion (Lightning's callback).

    At ``on_fit_start`` it runs :func:`torchrig.tune.lr_find`'s sweep (``num_training_steps``
    steps from ``min_lr`` to ``max_lr``, exponentially) on the fit's module, optimizer and
    training loader, puts them back, and keeps the result as :attr:`optimal_lr` (an
    :class:`~torchrig.tune.LRFinderResult`: ``suggestion()``, ``plot(path)``). With
    ``update_attr`` the suggestion is set on the module's ``attr_name`` (found as ``lr`` or
    ``learning_rate`` on the module or its hparams when not given) and ``configure_optimizers()``
    is asked again, so the fit trains as one given that learning rate directly:
    ``configure_optimizers`` must read it (``lr=self.lr``, as in Lightning's examples).

    Only the exponential sweep exists (``mode="exponential"``); one optimizer, automatic
    optimization.
    """

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        if mode != "exponential":
            raise ValueError(
                f"LearningRateFinder(mode={mode!r}): torchrig's sweep grows the learning rate exponentially "
                "only (torchrig.tune.lr_find); use mode='exponential'"
            )
        check_args(min_lr, max_lr, num_training_steps, early_stop_threshold)
        if not isinstance(update_attr, bool):
            raise TypeError(f"LearningRateFinder(update_attr={update_attr!r}) must be True or False")
        if not isinstance(attr_name, str):
            raise TypeError(f"LearningRateFinder(attr_name={attr_name!r}) must be a str ('' finds lr or learning_rate)")
        self.sweep = Sweep(float(min_lr), float(max_lr), int(num_training_steps), early_stop_threshold)
        self.update_attr, self.attr_name = update_attr, attr_name
        #: The sweep's result (None until it ran in this process).
        self.optimal_lr: LRFinderResult | None = None
        #: The learning rate set from the suggestion (kept in checkpoints).
        self.suggested_lr: float | None = None

    def _attribute(self, module: TrainingModule, trainer: Trainer) -> Attribute:
        datamodule = trainer.run.datamodule
        name = self.attr_name or next(
            (n for n in ("lr", "learning_rate") if holders(module, datamodule, n)), "lr or learning_rate"
        )
        return Attribute("LearningRateFinder", "attr_name", name, module, datamodule)

    def lr_find(self, trainer: Trainer, module: TrainingModule) -> None:
        """Sweep now and apply the suggestion (Lightning's method; ``on_fit_start`` calls it)."""
        attr = self._attribute(module, trainer) if self.update_attr else None
        optimizer = one_optimizer("LearningRateFinder", module, trainer.optimizers)
        rng = capture_rng(trainer.rig.device)
        try:
            self.optimal_lr = run_sweep(
                trainer, trainer.run.prepared_module, optimizer, trainer.run.train_loader, self.sweep
            )
        finally:
            restore_rng(rng, trainer.rig.device)
        if attr is None:
            return
        try:
            lr = self.optimal_lr.suggestion()
        except ValueError as err:
            warnings.warn(f"LearningRateFinder: no suggestion, the learning rate is left as is: {err}", stacklevel=2)
            return
        attr.set(lr)
        self.suggested_lr = lr
        trainer.rig.print(f"torchrig: LearningRateFinder: learning rate {lr:.4g} ({attr.name})")
        stages.remake_fit_setup(trainer, loaders=False, optimizers=True)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if _skipped_for_fast_dev_run(trainer, "LearningRateFinder"):
            return
        if trainer.run.resumed and self.suggested_lr is not None:  # the optimizer's state holds it already
            self._attribute(module, trainer).set(self.suggested_lr)
            return
        self.lr_find(trainer, module)

    def state_dict(self) -> dict[str, Any]:
        return {"suggested_lr": self.suggested_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lr = state.get("suggested_lr")
        self.suggested_lr = None if lr is None else float(lr)


def _skipped_for_fast_dev_run(trainer: Trainer, who: str) -> bool:
    """A ``fast_dev_run`` checks that the code runs: no search (as in Lightning), said once."""
    if not trainer.fast_dev_run:
        return False
    warnings.warn(f"{who}: skipped under fast_dev_run (a search takes many steps); the fit runs as given", stacklevel=3)
    return True
