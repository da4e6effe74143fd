"""``torchrig plan --devices 64 --tp 8 MODULE:FACTORY``: what every rank of an N-D parallel job holds.

Builds the model on ``meta`` and applies ``ModelParallelStrategy`` for every rank in this one
process with a fake process group (see :mod:`torchrig.planner`); prints each distinct layout's
parameter shards and the memory of every rank.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan",
        help="show each rank's parameter shards and memory for an N-D parallel layout, on one CPU",
        description=(
            "Plan a ModelParallelStrategy job without devices: the model is built on meta and split for every rank "
            "in a fake process group. Prints the parameter shards (local shape, placements) and, per rank, the "
            "memory of parameters, gradients and AdamW state in the chosen precision."
        ),
    )
    p.add_argument("model", help="MODULE:FACTORY, a function returning the model (e.g. torchrig.demo.transformer:tiny)")
    p.add_argument("--devices", type=int, required=True, help="devices (processes) per node")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (default 1); the world is devices x num-nodes")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel, pipeline stages (default 1)")
    p.add_argument("--pp-schedule", default="1F1B", help="GPipe, 1F1B (default), Interleaved1F1B or ZBVZeroBubble")
    p.add_argument("--pp-microbatches", type=int, default=None, help="microbatches per step (default 2 x stages)")
    p.add_argument(
        "--pp-split", nargs="+", default=None, metavar="MODULE", help="the first block of each stage after the first"
    )
    p.add_argument("--dp-replicate", type=int, default=1, help="data_parallel_replicate, HSDP replicas (default 1)")
    p.add_argument("--dp-shard", default="auto", help="data_parallel_shard (default auto: what is left)")
    p.add_argument("--precision", default="bf16-mixed", help="precision the memory is counted in (default bf16-mixed)")
    p.add_argument(
        "--input",
        default=None,
        metavar="MODULE:FN",
        help="a function returning the model's input: also run forward + backward as rank 0 on fake tensors",
    )
    p.add_argument("--rank", type=int, action="append", default=None, help="plan only this rank (repeatable)")
    p.add_argument("--all-params", action="store_true", help="list every parameter (default: the first 40)")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.set_defaults(handler=main)


def load_factory(spec: str) -> Any:
    """The object ``MODULE:NAME`` names; the current directory is importable (as for ``python -m``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} must be MODULE:FUNCTION, e.g. torchrig.demo.transformer:transformer_1b")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{spec!r}: cannot import {module_name!r} ({err})") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {attr!r} is a {type(obj).__name__}, not a function or class")
    return obj


def main(args: argparse.Namespace) -> int:
    """Exit 2, with one ``torchrig plan:`` line, for a wrong option or model; 1 when the model's
    own code fails while it is planned."""
    import json

    from torchrig import arguments
    from torchrig.planner import plan

    try:
        devices = arguments.int_in_range("--devices", args.devices, 1, hint=" (processes per node)")
        nodes = arguments.int_in_range("--num-nodes", args.num_nodes, 1, hint=" (the number of machines)")
        shard = args.dp_shard if args.dp_shard == "auto" else _dp_shard(args.dp_shard)
        factory = load_factory(args.model)
        step_input = load_factory(args.input) if args.input else None
        result = plan(
            factory,
            world_size=devices * nodes,
            data_parallel_replicate=args.dp_replicate,
            data_parallel_shard=shard,
            tensor_parallel=args.tp,
            pipeline_parallel=args.pp,
            pp_schedule=args.pp_schedule,
            pp_microbatches=args.pp_microbatches,
            pp_split=args.pp_split,
            precision=args.precision,
            ranks=args.rank,
            step_input=step_input,
        )
    except (ValueError, TypeError) as err:
        print(f"torchrig plan: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"torchrig plan: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.report(max_params=None if args.all_params else 40))
    return 0


def _dp_shard(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"--dp-shard={text!r} must be a count (an int >= 1) or 'auto' (what is left)")
    return int(text)
