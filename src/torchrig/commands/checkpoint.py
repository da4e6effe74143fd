"""`torchrig checkpoint` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("checkpoint", help="(not built yet)")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    raise SystemExit("torchrig checkpoint is not built yet")
