"""Learning curves of a run directory: loss and accuracy per epoch, training and validation, as a PNG."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from torchrig.demo import require_extras
from torchrig.trainer.loggers import read_metrics

PNG_NAME = "learning_curves.png"

#: (curve, the column names it may have, first match wins). ``_epoch`` is what a metric logged
#: both per step and per epoch is called in metrics.csv.
CURVES: dict[str, tuple[str, ...]] = {
    "train_loss": ("train_loss_epoch", "train_loss", "train/loss_epoch", "train/loss", "loss_epoch", "loss"),
    "val_loss": ("val_loss_epoch", "val_loss", "val/loss_epoch", "val/loss"),
    "train_acc": ("train_acc_epoch", "train_acc", "train_accuracy", "train/acc", "train/accuracy"),
    "val_acc": ("val_acc_epoch", "val_acc", "val_accuracy", "val/acc", "val/accuracy"),
}
_TEST_ACC = ("test_acc", "test_accuracy", "test/acc", "test/accuracy")


def epoch_curves(rows: Iterable[Mapping[str, float | int]]) -> dict[str, dict[int, float]]:
    """Per-epoch values of the learning curves found in metrics rows (``read_metrics`` output).

    Each curve maps epoch to the mean of the values logged in that epoch (one value when it
    was logged per epoch). Curves with no value are left out.

    Example:
        >>> epoch_curves([{"epoch": 0, "step": 9, "val_loss": 0.5}, {"epoch": 1, "step": 19, "val_loss": 0.25}])
        {'val_loss': {0: 0.5, 1: 0.25}}
    """
    rows = list(rows)
    columns = {key for row in rows for key in row}
    out: dict[str, dict[int, float]] = {}
    for curve, candidates in CURVES.items():
        column = next((c for c in candidates if c in columns), None)
        if column is None:
            continue
        sums: dict[int, list[float]] = {}
        for row in rows:
            if column in row and "epoch" in row:
                sums.setdefault(int(row["epoch"]), []).append(float(row[column]))
        if sums:
            out[curve] = {epoch: sum(v) / len(v) for epoch, v in sorted(sums.items())}
    return out


def _test_accuracy(rows: list[dict[str, float | int]]) -> float | None:
    for row in reversed(rows):
        for name in _TEST_ACC:
            if name in row:
                return float(row[name])
    return None


def plot_learning_curves(run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Path:
    """Render ``run_dir/metrics.csv`` as a PNG (default ``run_dir/learning_curves.png``); returns its path.

    ``run_dir`` may also be the CSV file itself (the PNG then goes next to it).

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.csv``.
        ValueError: the file holds no per-epoch loss or accuracy to draw.

    Example:
        >>> # plot_learning_curves("runs/demo/digits/version_0")
    """
    require_extras("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    source = Path(run_dir)
    run_dir = source.parent if source.is_file() else source  # a CSV file given: its folder is the run
    rows = read_metrics(source)
    curves = epoch_curves(rows)
    if not curves:
        found = sorted({key for row in rows for key in row} - {"step", "epoch"})
        csv_path = source if source.is_file() else source / "metrics.csv"
        raise ValueError(
            f"{csv_path} has no per-epoch loss or accuracy to plot; it has the columns "
            f"{found or 'none'}, and the plot looks for {', '.join(CURVES)} (with an epoch column)"
        )
    # The Figure API with an Agg canvas: no pyplot global state, no display needed.
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    for axes, kind, label in zip(figure.subplots(1, 2), ("loss", "acc"), ("loss", "accuracy"), strict=True):
        for stage, style in (("train", "-o"), ("val", "--s")):
            points = curves.get(f"{stage}_{kind}")
            if points:
                epochs = [e + 1 for e in points]  # "after epoch 1" reads better than epoch 0
                axes.plot(epochs, list(points.values()), style, label=f"{stage} {label}", markersize=4)
        axes.set_xlabel("epoch")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        if axes.has_data():
            axes.legend()
            axes.xaxis.get_major_locator().set_params(integer=True)
        else:
            axes.text(0.5, 0.5, f"no {label} logged", ha="center", va="center", transform=axes.transAxes)
    title = f"learning curves of {run_dir}"
    test_acc = _test_accuracy(rows)
    if test_acc is not None:
        title += f"  (test accuracy {test_acc:.2%})"
    figure.suptitle(title)
    path = Path(output) if output is not None else run_dir / PNG_NAME
    if path.is_dir():  # a folder given: the PNG goes into it
        path = path / PNG_NAME
    figure.savefig(path, format=path.suffix[1:] or "png")  # a name without a suffix is written as it is
    return path
