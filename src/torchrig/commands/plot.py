"""``torchrig plot RUN_DIR``: the learning-curve PNG of any run directory that has a ``metrics.csv``."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plot",
        help="draw the learning curves (loss and accuracy per epoch) of a run directory as a PNG",
        description="Draw loss and accuracy per epoch, training and validation, from RUN_DIR/metrics.csv "
        "(written by the Trainer's CSVLogger) into a PNG.",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run directory with a metrics.csv (e.g. runs/demo/digits/version_0), or that metrics.csv itself",
    )
    p.add_argument(
        "-o", "--output", help="the PNG file to write, or a folder to write learning_curves.png into (default: RUN_DIR)"
    )
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from torchrig.demo import MissingExtraError

    try:
        from torchrig.demo.plot import plot_learning_curves

        path = plot_learning_curves(args.run_dir, args.output)
    except (OSError, ValueError, MissingExtraError) as err:  # NotADirectoryError, PermissionError included
        print(f"torchrig plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
