"""A 2-process Trainer fit for the preemption tests.

    python preempt_fit.py ROOT OUT [--signal SIGTERM --signal-rank 1 --signal-at 8] [--sleep-rank 0]
                                   [--resume] [--launcher]

``--signal``: at optimizer step ``--signal-at`` the process of rank ``--signal-rank`` sends itself
that signal (as a scheduler that signals one process does); ``--sleep-rank R`` makes rank R sleep
2 s at that step, so it is late to every collective after it. ``--resume``: ``fit(ckpt_path="last")``.
``--launcher``: the processes come from torchrig's own launcher (``devices=2``); else from the
environment (torchrun, or SLURM variables set by the test as ``srun`` would). ``--ready FILE``:
rank 0 creates FILE after step 3, for a test that signals from outside; ``--step-sleep S`` slows
every batch down, ``--first-run-sleep S`` only those of the first attempt (a job that meets its
time limit's warning, whose requeued run does not). ``--kill-at N``: rank 1 SIGKILLs itself at step N
of the first attempt. The first attempt is restart count 0 (``TORCHELASTIC_RESTART_COUNT``,
``SLURM_RESTART_COUNT``, as torchrig reads them). ``--save-every N``: a ``ModelCheckpoint`` every
N steps. Rank 0 writes the final weights to OUT; every rank prints ``rank R of W launched by
KIND`` (the detected launcher) first, and ``rank R saved step S`` from ``last`` when the fit stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import torchrig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainer"))
from trainer_helpers import Regressor, loader


class Signal(torchrig.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.first_attempt = torchrig.CLUSTER_ENVIRONMENTS.restart_count() == 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        a, rank = self.args, trainer.rig.global_rank
        if a.ready and trainer.global_step == 3 and rank == 0:
            Path(a.ready).touch()  # the test sends its signal from outside now
        time.sleep(a.step_sleep + (a.first_run_sleep if self.first_attempt else 0.0))
        if a.kill_at and trainer.global_step == a.kill_at and rank == 1 and self.first_attempt:
            print(f"rank 1 SIGKILLs itself at step {a.kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # a dead worker: nothing can be saved
        if trainer.global_step != a.signal_at:
            return
        if a.signal and rank == a.signal_rank:
            os.kill(os.getpid(), signal.Signals[a.signal])
        if rank == a.sleep_rank:
            time.sleep(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--signal", default="")
    parser.add_argument("--signal-rank", type=int, default=1)
    parser.add_argument("--signal-at", type=int, default=8)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--launcher", action="store_true")
    parser.add_argument("--spawn", action="store_true", help="strategy='ddp_spawn' (2 workers)")
    parser.add_argument("--logger", action="store_true")
    parser.add_argument("--ready", default="", help="rank 0 creates this file after step 3")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each batch sleeps")
    parser.add_argument("--first-run-sleep", type=float, default=0.0, help="more seconds per batch, first attempt")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=0, help="rank 1 SIGKILLs itself at this step (first attempt)")
    parser.add_argument("--save-every", type=int, default=0, help="a checkpoint every this many steps")
    args = parser.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    module = Regressor(dropout=0.25)  # dropout: the RNG streams must continue exactly too
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=2 if args.launcher or args.spawn else None,
        strategy="ddp_spawn" if args.spawn else "ddp",
        max_epochs=args.epochs,
        seed=123,
        enable_progress_bar=False,
        logger=args.logger,
        default_root_dir=args.root,
        callbacks=[Signal(args)]
        + ([torchrig.ModelCheckpoint(every_n_train_steps=args.save_every, save_last=True)] if args.save_every else []),
        num_sanity_val_steps=0,
    )
    launcher = torchrig.detect_environment()
    print(f"rank {launcher.global_rank} of {launcher.world_size} launched by {launcher.kind}", flush=True)
    try:
        trainer.fit(module, loader(48, batch_size=4, shuffle=True), ckpt_path="last" if args.resume else None)
    except torchrig.Preempted as stop:
        print(f"rank {trainer.rig.global_rank} saved step {trainer.global_step} at {stop.saved}", flush=True)
        raise
    if trainer.rig.is_global_zero:
        torch.save(module.state_dict(), args.out)
    print(f"rank {trainer.rig.global_rank} done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
