"""The ``torchrig`` console script: ``env``, ``run``, ``demo``, ``plot``, ``checkpoint``, ``plan``.

Each subcommand lives in :mod:`torchrig.commands` as a module with ``add_parser(subparsers)``
and ``main(args) -> int``. ``torchrig.cli.CLI`` (the jsonargparse fit/validate/test/predict
front end for your own scripts) is re-exported from :mod:`torchrig.trainer.cli`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

COMMANDS = ("env", "run", "demo", "plot", "checkpoint", "plan")


class CommandParser(argparse.ArgumentParser):
    """The parser of ``torchrig`` and of each subcommand (``add_subparsers`` makes its parsers of
    the parent's class): options are never abbreviated (``--max-epoch`` is not ``--max-epochs``,
    and a script's ``--ma`` after ``torchrig run script.py`` stays the script's), and an argument
    no parser knows is refused by the subcommand that got it, with that subcommand's usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:  # argparse would hand them up to the top-level parser, whose usage says nothing of them
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    from torchrig import __version__

    parser = CommandParser(
        prog="torchrig", description="Run one PyTorch training program on any hardware and any number of processes."
    )
    parser.add_argument("--version", action="version", version=f"torchrig {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"torchrig.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchrig`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.handler(args) or 0)


def __getattr__(name: str) -> Any:
    if name == "CLI":
        from torchrig.trainer.cli import CLI

        return CLI
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(main())
