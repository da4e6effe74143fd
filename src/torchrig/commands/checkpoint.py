"""``torchrig checkpoint inspect PATH``, ``torchrig checkpoint consolidate PATH OUT`` and
``torchrig checkpoint import PATH OUT``.

``inspect`` verifies every file against its SHA-256 and prints what the checkpoint holds;
``consolidate`` writes the model weights (sharded or not) as one ``.safetensors`` file;
``import`` converts a Lightning ``.ckpt`` or an Accelerate ``save_state`` directory into a
torchrig checkpoint (:mod:`torchrig.checkpoint.peers`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "checkpoint",
        help="inspect a checkpoint, consolidate one into a single safetensors file, or import a Lightning or "
        "Accelerate checkpoint",
        description="Look into torchrig checkpoints (directories written by rig.save).",
    )
    cmds = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    ins = cmds.add_parser("inspect", help="verify the files and print what a checkpoint holds")
    ins.add_argument("path", help="the checkpoint directory (or its 'last' link)")
    ins.add_argument("--json", action="store_true", help="print meta.json plus the verification as JSON")
    con = cmds.add_parser("consolidate", help="write the model weights as one .safetensors file")
    con.add_argument("path", help="the checkpoint directory (sharded or not)")
    con.add_argument("out", help="the .safetensors file to write")
    imp = cmds.add_parser(
        "import",
        help="convert a Lightning .ckpt or an Accelerate save_state directory into a torchrig checkpoint",
        description="Write a Lightning .ckpt file or a directory Accelerate's save_state wrote as a torchrig "
        "checkpoint that rig.load and Trainer(ckpt_path=OUT) resume from. Nothing in the files runs: a file that "
        "needs code to unpickle is refused with the Python objects it names.",
    )
    imp.add_argument("path", help="a Lightning .ckpt file, or the directory Accelerate's save_state wrote")
    imp.add_argument("out", help="the torchrig checkpoint directory to write (an existing one is replaced)")
    imp.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="keep only the module keys that start with PREFIX, without it ('model.': Lightning's 'model.weight' "
        "becomes 'weight', for a plain module)",
    )
    imp.add_argument("--add-prefix", metavar="PREFIX", help="put PREFIX before every module key (after --strip-prefix)")
    imp.add_argument(
        "--optimizer",
        metavar="CLASS",
        action="append",
        default=[],
        help="the class of each optimizer, in order (e.g. torch.optim.AdamW); default: inferred from its fields",
    )
    imp.add_argument(
        "--scheduler",
        metavar="CLASS",
        action="append",
        default=[],
        help="the class of each LR scheduler, in order (e.g. torch.optim.lr_scheduler.StepLR); default: inferred",
    )
    imp.add_argument(
        "--seed", type=int, default=0, help="the RNG state to write when the source has none (Lightning): seed N's"
    )
    p.set_defaults(handler=main, checkpoint_parser=p)


def main(args: argparse.Namespace) -> int:
    """Exit 0 when done (``inspect``: every file matches its SHA-256); 1 when the checkpoint is
    damaged (a file ``meta.json`` lists is missing, of another size or SHA-256, or not a regular
    file: ``inspect`` lists it as MISMATCH, ``consolidate`` stops on it); 2, with one
    ``torchrig checkpoint ACTION:`` line, for any other refusal (no such path, not a checkpoint or
    not the kind of file the action takes, an ``OUT`` it cannot write, a wrong option)."""
    import sys

    from torchrig.checkpoint.errors import DamagedCheckpointError

    action = getattr(args, "checkpoint_command", None)
    if action is None:
        args.checkpoint_parser.print_help()
        return 2
    try:
        return {"inspect": _inspect, "consolidate": _consolidate, "import": _import}[action](args)
    except (OSError, ValueError, TypeError) as err:  # CheckpointError is a ValueError: a message, never a traceback
        print(f"torchrig checkpoint {action}: {str(err).replace(chr(10), ' ')}", file=sys.stderr)
        return 1 if isinstance(err, DamagedCheckpointError) else 2


def _consolidate(args: argparse.Namespace) -> int:
    from torchrig.checkpoint import consolidate

    out = consolidate(args.path, args.out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _import(args: argparse.Namespace) -> int:
    from torchrig.checkpoint.peers import import_checkpoint

    done = import_checkpoint(
        args.path,
        args.out,
        strip_prefix=args.strip_prefix,
        add_prefix=args.add_prefix,
        optimizers=args.optimizer,
        schedulers=args.scheduler,
        seed=args.seed,
    )
    print(f"imported {done.source} checkpoint {args.path}")
    for line in done.lines:
        print(f"  {line}")
    for line in done.warnings:
        print(f"warning: {line}")
    size = sum(p.stat().st_size for p in done.path.iterdir())
    print(f"wrote {done.path} ({_size(size)})")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from torchrig.checkpoint import describe

    info = describe(args.path)
    ok = all(good for _, _, good in info["verified"])
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_tables(info)
    return 0 if ok else 1  # a damaged checkpoint, as main says


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _epoch_text(info: dict[str, Any]) -> str | None:
    """The ``epoch`` row: a Trainer checkpoint's (one with the Trainer's loop state) says how it
    counts; any other's is the value its code saved, shown as it is."""
    from torchrig.checkpoint.entries import class_name
    from torchrig.trainer.loops import FitState

    epoch = info.get("epoch")
    if epoch is None or info["entries"].get("loop", {}).get("type") != class_name(FitState):
        return None if epoch is None else str(epoch)
    return f"{epoch} (counted from 0: the epoch of its last step)"  # the E of its name epoch=E-step=S


def _print_tables(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()  # every text from meta.json is escaped: a '[' in it is not rich markup
    console.print(f"[bold]checkpoint[/] {escape(info['path'])}", soft_wrap=True, highlight=False)
    head = Table(show_header=False)
    rows = [
        ("created", info.get("created")),
        ("layout", "sharded (torch.distributed.checkpoint)" if info.get("sharded") else "whole"),
        ("world size", info.get("world_size")),
        ("step", info.get("step")),
        ("epoch", _epoch_text(info)),
        ("tensors", info.get("tensors")),
        ("parameters", f"{info.get('parameters', 0):,}"),
        ("buffers", None if info.get("buffers") is None else f"{info['buffers']:,}"),  # older checkpoints: -
        ("saved on", f"{info.get('device_type')} · precision {info.get('precision')}"),
        ("versions", f"torch {info.get('torch')} · torchrig {info.get('torchrig')}"),
    ]
    for k, v in rows:
        head.add_row(k, "-" if v is None else escape(str(v)))
    console.print(head)
    entries = Table(title="entries")
    entries.add_column("key")
    entries.add_column("kind")
    entries.add_column("type")
    for key, e in sorted(info["entries"].items()):
        value = info.get("values", {}).get(key, "") if e["kind"] == "value" else ""
        entries.add_row(escape(key), e["kind"], escape(f"{e['type']} {value}".strip()))
    console.print(entries)
    files = Table(title="files")
    files.add_column("file")
    files.add_column("size", justify="right")
    files.add_column("sha256")
    files.add_column("verified")
    for name, size, good in info["verified"]:
        mark = "[green]ok[/]" if good else "[bold red]MISMATCH[/]"
        files.add_row(escape(name), _size(size), info["files"][name]["sha256"][:16] + "…", mark)
    console.print(files)
