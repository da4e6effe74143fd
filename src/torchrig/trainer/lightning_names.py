"""Lightning's names for callbacks torchrig has under its own: each class takes Lightning's
arguments and behaves as the torchrig feature it names (docs/migrating.md lists them).

| Lightning | torchrig |
|---|---|
| ``OnExceptionCheckpoint(dirpath, filename)`` | ``ModelCheckpoint(save_on_exception=True)`` saving nothing else |
| ``ModelSummary(max_depth)``, ``RichModelSummary`` | the summary of ``enable_model_summary`` |
| ``TQDMProgressBar``, ``RichProgressBar`` | :class:`~torchrig.ProgressBar` |
| ``EMAWeightAveraging(decay)`` | :class:`~torchrig.EMA` |
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchrig import arguments
from torchrig.trainer.callbacks import Callback
from torchrig.trainer.checkpointing import ModelCheckpoint
from torchrig.trainer.ema import EMA
from torchrig.trainer.progress import ProgressBar


class OnExceptionCheckpoint(ModelCheckpoint):
    """Save a checkpoint when the fit raises, and nothing else (Lightning's name for
    ``ModelCheckpoint(save_on_exception=True, save_top_k=0)``; the checkpoint is named
    ``filename`` in ``dirpath`` and becomes ``last`` there).

    As in Lightning, it counts as the run's checkpoint callback: with it the Trainer adds no
    default :class:`ModelCheckpoint`.
    """

    def __init__(self, dirpath: str | Path, filename: str = "on_exception") -> None:
        super().__init__(dirpath=dirpath, filename=filename, save_top_k=0, save_on_exception=True)


class ModelSummary(Callback):
    """The model summary a fit prints when it starts, down to ``max_depth`` levels of submodules
    (``1``: the top-level layers, as ``enable_model_summary=True`` prints; ``-1``: every level;
    ``0``: no summary). With one of these in ``callbacks`` the Trainer prints this one's."""

    def __init__(self, max_depth: int = 1) -> None:
        self.max_depth = arguments.int_in_range("max_depth", max_depth, -1, hint=" (-1: every level; 0: none)")


class RichModelSummary(ModelSummary):
    """Lightning's rich summary: torchrig's summary is a rich table already (see :class:`ModelSummary`)."""


class TQDMProgressBar(ProgressBar):
    """Lightning's TQDM bar, as torchrig's :class:`~torchrig.ProgressBar` (rich; it redraws
    every ``refresh_interval`` seconds, not every ``refresh_rate`` batches: any ``refresh_rate``
    above 0 shows the same bar; 0 is refused, use ``enable_progress_bar=False``)."""

    def __init__(self, refresh_rate: int = 1, **progress_bar: Any) -> None:
        rate = arguments.int_in_range("refresh_rate", refresh_rate, 0)
        if rate == 0:
            raise ValueError(
                f"{type(self).__name__}(refresh_rate=0) hides the bar; use Trainer(enable_progress_bar=False)"
            )
        super().__init__(**progress_bar)


class RichProgressBar(TQDMProgressBar):
    """Lightning's rich bar: torchrig's :class:`~torchrig.ProgressBar` (see :class:`TQDMProgressBar`)."""


class EMAWeightAveraging(EMA):
    """Lightning's exponential moving average callback, as :class:`~torchrig.EMA`: the average is
    updated after every optimizer step and kept where the weights are. Lightning's other
    arguments have no torchrig counterpart and are refused unless left at their defaults."""

    def __init__(
        self,
        device: Any = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
    ) -> None:
        given = {
            "device": (device, None, "the average stays on the weights' device"),
            "use_buffers": (use_buffers, True, "floating-point buffers are always averaged"),
            "update_every_n_steps": (update_every_n_steps, 1, "the average is updated after every step"),
            "update_starting_at_step": (update_starting_at_step, None, "the average starts with the fit"),
            "update_starting_at_epoch": (update_starting_at_epoch, None, "the average starts with the fit"),
        }
        for name, (value, default, why) in given.items():
            if value != default:
                raise ValueError(
                    f"EMAWeightAveraging({name}={value!r}) has no torchrig counterpart: {why} (torchrig.EMA); "
                    f"leave {name} at its default ({default!r})"
                )
        super().__init__(decay=decay)
