"""``torchrig run``: start a script on N processes per machine through torchrun.

    torchrig run --devices 2 script.py ARGS
    torchrig run --devices 8 --num-nodes 2 --node-rank 0 --master-addr HOST --master-port 29500 script.py ARGS

The processes are started by ``torch.distributed.run`` (torchrun's Python API), which also
watches them: when one fails the others are stopped. Each worker's own output (its traceback)
goes straight to this terminal; torchrun's summary is replaced by one line naming the rank that
failed first and its exit code. Each worker gets at most ``cores // processes`` intra-op CPU
threads (``OMP_NUM_THREADS``) unless ``OMP_NUM_THREADS`` is already set.
``--accelerator``, ``--devices``, ``--strategy``, ``--precision`` and ``--num-nodes`` reach the
script through the ``TORCHRIG_*`` variables that ``Rig()`` and ``Trainer()`` read as defaults.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run",
        help="run a script on N processes (and M machines) through torchrun",
        description="Run a script on N processes per machine through torch.distributed.run (torchrun).",
    )
    p.add_argument("--devices", default="auto", help="processes per machine: a count, 'auto', or indices '0,1'")
    p.add_argument("--num-nodes", type=int, default=1, help="number of machines (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..num-nodes-1")
    p.add_argument("--master-addr", default=None, help="address of the node-rank-0 machine (multi-node)")
    p.add_argument("--master-port", type=int, default=None, help="a free TCP port on that machine")
    p.add_argument("--accelerator", default=None, help="passed to the script as TORCHRIG_ACCELERATOR")
    p.add_argument("--strategy", default=None, help="passed to the script as TORCHRIG_STRATEGY")
    p.add_argument("--precision", default=None, help="passed to the script as TORCHRIG_PRECISION")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to N times when one fails (torchrun's --max-restarts); a restart "
        "that commits no checkpoint after one that also committed none stops the job",
    )
    p.add_argument("script", help="the Python script to run")
    # Everything after the script is the script's, untouched (its own --max or --ma included).
    rest = p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    rest.required = False  # argparse counts a REMAINDER as required: "required: script, script_args"
    p.set_defaults(handler=main)


def checked_process_count(args: argparse.Namespace) -> int:
    """How many processes ``--devices`` means on this machine for ``--accelerator``, once every
    option the workers will read is checked (so a wrong one fails here, not in every worker)."""
    from torchrig import arguments
    from torchrig.resolve import check_launch_choices, resolve_accelerator, resolve_devices

    arguments.int_in_range("--num-nodes", args.num_nodes, 1, hint=" (the number of machines)")
    acc = resolve_accelerator(args.accelerator or "auto")
    spec: Any = args.devices
    if isinstance(spec, str) and spec.strip().lstrip("-").isdigit():
        spec = int(spec)
    devices = resolve_devices(acc, spec)
    check_launch_choices(strategy=args.strategy, precision=args.precision, devices=devices, num_nodes=args.num_nodes)
    return len(devices)


def torchrun_args(args: argparse.Namespace, nproc: int) -> list[str]:
    """The ``torch.distributed.run`` command line for ``args``."""
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts} must be 0 or more")
    if not 0 <= args.node_rank < args.num_nodes:
        raise ValueError(
            f"--node-rank {args.node_rank} must be in 0..{args.num_nodes - 1} (--num-nodes {args.num_nodes})"
        )
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ValueError(f"--master-port {args.master_port} must be a TCP port, 1..65535")
    out = [f"--nproc-per-node={nproc}", f"--nnodes={args.num_nodes}", f"--max-restarts={args.max_restarts}"]
    if args.num_nodes == 1 and args.master_addr is None and args.master_port is None:
        out.append("--standalone")  # a private rendezvous on a free local port
    else:
        if args.master_addr is None or args.master_port is None:
            raise ValueError(
                f"--num-nodes {args.num_nodes} needs --master-addr and --master-port (the address of the "
                "node-rank-0 machine and a free port there), the same on every machine"
            )
        out += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}"]
        out.append(f"--master-port={args.master_port}")
    return [*out, args.script, *args.script_args]


def script_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``TORCHRIG_*`` defaults the script's ``Rig()``/``Trainer()`` will read."""
    from torchrig.resolve import ENV_DEFAULTS

    env = {ENV_DEFAULTS["devices"]: str(args.devices), ENV_DEFAULTS["num_nodes"]: str(args.num_nodes)}
    for name in ("accelerator", "strategy", "precision"):
        value = getattr(args, name)
        if value is not None:
            env[ENV_DEFAULTS[name]] = str(value)
    return env


def main(args: argparse.Namespace) -> int:
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from torchrig.strategies.launch import thread_env, worker_threads
    from torchrig.strategies.parallel import STOP_FILE_ENV

    if not os.path.isfile(args.script):
        problem = "is a directory, not a Python script" if os.path.isdir(args.script) else "no such script"
        print(f"torchrig run: {args.script}: {problem}", file=sys.stderr)
        return 2
    try:
        nproc = checked_process_count(args)
        launch = torchrun_args(args, nproc)
    except ValueError as err:
        print(f"torchrig run: {err}", file=sys.stderr)
        return 2
    os.environ.update(script_env(args))
    os.environ.update(thread_env(worker_threads(nproc)))  # set, so torchrun does not set 1 and warn
    with tempfile.TemporaryDirectory(prefix="torchrig-run-") as tmp:
        stop_file = os.path.join(tmp, "stop")
        os.environ[STOP_FILE_ENV] = stop_file  # a worker that stops the job (crash loop) says why there
        try:
            return launch_workers(args, launch)
        except SignalException as err:
            if os.path.exists(stop_file):
                with open(stop_file, encoding="utf-8") as f:
                    print(f"torchrig run: {args.script} stopped: {f.read()}", file=sys.stderr)
                return 1
            # torchrun passed the signal to the workers and waited for them (up to 30 s): a
            # torchrig Trainer (or a loop with rig.preempted()) has saved and stopped by now.
            name = signal.Signals(err.sigval).name
            print(
                f"torchrig run: {args.script} stopped by {name} (the workers' output above says what they saved)",
                file=sys.stderr,
            )
            return 128 + int(err.sigval)


def torchrun_config(launch: list[str], script_args: list[str]) -> argparse.Namespace:
    """torchrun's parsed configuration for ``launch`` (its options, then the script and its arguments).

    torchrun's parser sees only its options and the script: given the script's arguments too, it
    would read an abbreviation of its own options in them (``--ma``, ``--max``) and fail or take them.
    """
    from torch.distributed.run import get_args_parser

    head = launch[: len(launch) - len(script_args)] if script_args else launch
    config = get_args_parser().parse_args(head)
    config.training_script_args = list(script_args)
    return config


def launch_workers(args: argparse.Namespace, launch: list[str]) -> int:
    """Run torchrun with ``launch``; 0, or 1 with one line naming the rank that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from torchrig.preemption import stopped_for_signal

    try:
        run(torchrun_config(launch, args.script_args))
    except ChildFailedError as err:
        # torchrun has already stopped the other ranks. The failing rank's traceback is on its
        # stderr, above; torchrun's summary would only repeat it, or, for an error raised before
        # Rig() (nothing wrote torchrun's error file), say "To enable traceback see: ...".
        rank, first = err.get_first_failure()
        if stopped_for_signal(first.exitcode):  # the workers stopped for a signal, after saving
            print(f"torchrig run: {args.script} stopped: rank {rank} exited with {first.exitcode}", file=sys.stderr)
            return int(first.exitcode) if first.exitcode > 0 else 128 - int(first.exitcode)
        print(f"torchrig run: {args.script} failed: {failure_summary(rank, first)}", file=sys.stderr)
        return 1
    return 0


def failure_summary(rank: int, failure: Any) -> str:
    """``rank R failed first (exit code C)``, with the error when the rank recorded it (an error
    after ``Rig()``, through torchrig's failure report) or the signal that stopped it."""
    text = f"rank {rank} failed first (exit code {failure.exitcode})"
    if isinstance(failure.message, dict):  # written to torchrun's error file by the rank itself
        message = failure.message.get("message", "")
    else:  # torchrun's own words: the signal, or a pointer to its documentation
        message = failure.message if failure.exitcode < 0 else ""
    return f"{text}: {message}" if message else text
