"""Stopping for a scheduler's signal: every rank at the same optimizer step, the state saved.

Clusters warn a job before they kill it: SLURM sends ``SIGUSR1`` (with ``--signal=USR1@90``) or
``SIGTERM``, Kubernetes and ``scancel`` send ``SIGTERM``, a terminal sends ``SIGINT``. Often only
some processes get the signal, and each at its own moment. So a handler here only notes the signal
(:class:`SignalWatch`); the ranks then *agree* at a point every rank passes at the same step:

* **One process**: :meth:`SignalWatch.poll` reads the note; nothing else.
* **Several processes**: at a *check*, a poll starts an asynchronous ``all_reduce(MAX)`` of this
  rank's note (a two-int CPU tensor on a gloo group: the default group when it is gloo, else a gloo
  group made once for this) and reads the result of the previous check's all-reduce, which has
  long finished by then. The training loop never waits for it and the device is never synchronised.
  Checks come about every ``TORCHRIG_SIGNAL_CHECK_INTERVAL`` seconds (1 by default; 0: at every
  poll): the all-reduce also carries each rank's count of polls per interval (from its own clock,
  at most twice the last agreed count), and every rank takes the agreed minimum as the number of
  polls to the next check. So every rank
  checks at the same polls and reads the same agreed value there: the stop comes at the same step
  on every rank, about two intervals after the first rank got the signal. One small all-reduce a
  second costs nothing measurable, where one per step cost 5-8% of a small DDP step on this CPU
  (``benchmarks/ddp_overhead.py``).

A stop signal in the Trainer ends the fit at the next optimizer step on every rank, saves ``last``
there and raises :class:`Preempted` (exit status ``128 + signal``; 0 when the job was requeued).
When the fit returns, the handlers are put back as they were, but for a warning signal
(:data:`WARNING_SIGNALS`) that had its default action: that action would end the process, so a
warning that comes after training is said on stderr and ignored instead (:func:`late_warning`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from types import FrameType, TracebackType
from typing import Any

import torch

#: Which signals are watched when asked for ``"auto"``.
AUTO = "auto"
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
SignalsLike = str | int | signal.Signals | Sequence[str | int | signal.Signals] | None
#: Signals a scheduler sends to warn a job that its end is near (SLURM's ``--signal=USR1@90``), not
#: to end the process, yet whose default action ends it (status 138 for SIGUSR1). Once a fit that
#: watched one has returned, the warning is for a run that is over: :func:`late_warning` takes it.
WARNING_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})


def late_warning(signum: int, frame: FrameType | None) -> None:
    """The handler of a warning signal after the fit that watched it returned: the training and its
    checkpoints are done, so the process goes on (its work after the fit too) and stderr says why.
    Installed until the process ends, a later fit (which watches the signal again), or the
    program's own ``signal.signal``."""
    name = signal.Signals(signum).name
    os.write(
        2,
        f"\ntorchrig: {name} came after fit() returned: the training and its checkpoints are done, so it is "
        f"ignored (signal.signal(signal.{name}, handler) to act on it yourself)\n".encode(),
    )


class Preempted(SystemExit):
    """The run stopped for a signal after saving its state on every rank.

    A ``SystemExit``: uncaught, the process exits quietly with status ``128 + signum`` (143 for
    SIGTERM, 138 for SIGUSR1), the status a process killed by that signal reports to a shell, so
    schedulers and ``&&`` chains see that it did not finish; status 0 when the job was requeued
    (SLURM), since it goes on in its next allocation. ``signum`` and ``requeued`` say which.
    """

    def __init__(self, signum: int, requeued: bool = False, saved: str | None = None) -> None:
        self.signum = signal.Signals(signum)
        self.requeued = requeued
        self.saved = saved
        super().__init__(0 if requeued else 128 + int(signum))

    def __str__(self) -> str:
        what = "requeued" if self.requeued else f"exit status {self.code}"
        return f"stopped by {self.signum.name} ({what})"


def stopped_for_signal(code: int | None) -> bool:
    """Whether a process's exit status says it stopped for a signal after saving (a
    :class:`Preempted` exit, 128 + signal, or ``KeyboardInterrupt``'s SIGINT), not a failure."""
    return code is not None and (code == -signal.SIGINT or 128 < code <= 128 + signal.SIGRTMAX)


def under_slurm() -> bool:
    """Whether this process runs in a SLURM job (batch or step)."""
    from torchrig.clusters import SlurmEnvironment

    return SlurmEnvironment.job_id(os.environ) is not None


def _one_signal(value: str | int | signal.Signals, what: str) -> signal.Signals:
    try:
        if isinstance(value, str):
            name = value.strip().upper()
            sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        elif isinstance(value, bool) or not isinstance(value, int):
            raise TypeError
        else:
            sig = signal.Signals(value)
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"{what}={value!r} is not a signal; give names such as 'SIGTERM', 'SIGUSR1' (or 'TERM', 15)"
        ) from None
    if sig in _UNCATCHABLE:
        raise ValueError(f"{what}={value!r}: {sig.name} cannot be caught, so no process can save on it")
    return sig


def resolve_signals(value: SignalsLike, what: str = "stop_signals") -> tuple[signal.Signals, ...]:
    """The signals ``value`` names. ``"auto"``: SIGTERM and SIGINT, and SIGUSR1 under SLURM;
    ``None`` or ``()``: none."""
    if value is None:
        return ()
    if isinstance(value, str) and value.strip().lower() == AUTO:
        auto = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGUSR1] if under_slurm() else [])
        return tuple(auto)
    items: Iterable[Any] = [value] if isinstance(value, (str, int)) else value
    if not isinstance(items, Iterable):
        raise ValueError(f"{what}={value!r}; give a signal name, a list of them, 'auto' or None")
    found: list[signal.Signals] = []
    for item in items:
        sig = _one_signal(item, what)
        if sig not in found:
            found.append(sig)
    return tuple(found)


def resolve_requeue_signal(value: str | int | signal.Signals | None) -> signal.Signals | None:
    """The signal on which a SLURM job is requeued. ``"auto"``: SIGUSR1 under SLURM, else none."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return signal.SIGUSR1 if under_slurm() else None
    return _one_signal(value, "requeue_signal")


#: Seconds of training between two checks of several ranks (0: at every poll).
INTERVAL_ENV = "TORCHRIG_SIGNAL_CHECK_INTERVAL"
_MAX_POLLS = 1_000_000


def check_interval() -> float:
    """``TORCHRIG_SIGNAL_CHECK_INTERVAL`` in seconds (default 1.0)."""
    raw = os.environ.get(INTERVAL_ENV, "1")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{INTERVAL_ENV}={raw!r} must be seconds >= 0 (0: check at every step)")
    return value


def polls_per_interval(interval: float, polls: int, seconds: float) -> int:
    """How many polls fit in ``interval`` seconds, having made ``polls`` in ``seconds``."""
    if interval <= 0 or polls <= 0:
        return 1
    if seconds <= 0:
        return _MAX_POLLS
    return max(1, min(_MAX_POLLS, int(interval * polls / seconds)))


class SignalWatch:
    """Notes the first of ``signals`` this process gets; :meth:`poll` agrees on it across ranks.

    Handlers are installed (by :meth:`install` or ``with``) only from the main thread and only for
    signals that still have their default disposition (Python's ``KeyboardInterrupt`` for SIGINT;
    :func:`late_warning`, left by an earlier fit): a handler the program installed itself, or an
    ignored signal, is left alone. :meth:`restore` puts them back, but a warning signal
    (:data:`WARNING_SIGNALS`) that had its default action gets :func:`late_warning`. A second SIGINT
    raises ``KeyboardInterrupt`` at once, as without torchrig; other signals repeated while the run
    stops are noted once (a second SIGTERM does not cut the save short).

    Args:
        strategy: the run's strategy (its ``world_size``, ``global_rank`` and process group).
        signals: the signals to watch.
    """

    def __init__(self, strategy: Any, signals: Sequence[signal.Signals]) -> None:
        self.strategy = strategy
        self.signals = tuple(signals)
        self.received = 0  # the first watched signal this process got (0: none)
        self.interval = check_interval() if strategy.world_size > 1 else 0.0
        self._agreed = 0
        self._calls = 0
        self._next_check = 1  # the poll (counted from 1) at which the ranks next check
        self._polls = 1  # polls from one check to the next, as the ranks last agreed
        self._since: tuple[int, float] = (0, time.perf_counter())  # polls and clock at the last check
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._group: Any = None

    # -- handlers ----------------------------------------------------------------------------
    def install(self) -> SignalWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            current = signal.getsignal(sig)
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            if (current is default or current is late_warning) and sig not in self._previous:
                self._previous[sig] = current
                signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put the handlers back as they were (a warning signal's default action: :func:`late_warning`);
        a check still in flight is dropped."""
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                late = sig in WARNING_SIGNALS and handler is signal.SIG_DFL
                signal.signal(sig, late_warning if late else handler)
        self._previous.clear()
        self._pending = None

    def __enter__(self) -> SignalWatch:
        return self.install()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:  # the next Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.received:
            return
        self.received = signum
        name = signal.Signals(signum).name
        who = f"rank {self.strategy.global_rank}" if self.strategy.world_size > 1 else "torchrig"
        again = "; Ctrl-C again stops at once" if signum == signal.SIGINT else ""
        os.write(2, f"\n{who}: {name}: stopping at the next optimizer step to save it{again}\n".encode())

    # -- agreement ----------------------------------------------------------------------------
    def poll(self) -> int:
        """The signal every rank agreed to stop for (0: none). Collective: every rank calls it at
        the same points; never waits (a check reads the agreement the previous check started)."""
        if self.strategy.world_size == 1:
            return self.received
        self._calls += 1
        if self._agreed or self._calls < self._next_check:
            return self._agreed
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].wait()
            self._agreed, self._polls = int(pending[1][0]), -int(pending[1][1])
        if not self._agreed:
            self._pending = self._start()
            self._next_check = self._calls + self._polls
        return self._agreed

    def settle(self) -> int:
        """Finish the agreement now (blocking; collective): the signal any rank has got so far."""
        if self.strategy.world_size == 1:
            return self.received
        pending, self._pending = self._pending, None
        if not self._agreed and pending is not None:
            pending[0].wait()
            self._agreed = int(pending[1][0])
        if not self._agreed:
            work, flag = self._start()
            work.wait()
            self._agreed = int(flag[0])
        return self._agreed

    def _start(self) -> tuple[Any, torch.Tensor]:
        import torch.distributed as dist

        if self._group is None:
            self._group = control_group()
        calls, clock = self._since
        now = time.perf_counter()
        self._since = (self._calls, now)
        # This rank's count of polls to the next check, at most twice the agreed one (a burst of
        # quick polls, such as the one between two epochs, cannot make it jump); the ranks take
        # the smallest (the maximum of the negated counts).
        polls = min(polls_per_interval(self.interval, self._calls - calls, now - clock), 2 * self._polls)
        flag = torch.tensor([self.received, -polls], dtype=torch.int64)
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag


def control_group() -> Any:
    """A process group that carries small CPU tensors: the default one when it is gloo, else a
    gloo group over every rank, made on first use (collectively) and kept while the default
    group lives."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    world = dist.group.WORLD
    if _CONTROL.get("for") is not world:
        _CONTROL.update({"for": world, "group": dist.new_group(backend="gloo")})
    return _CONTROL["group"]


_CONTROL: dict[str, Any] = {}


def restart_count() -> int:
    """How many times a launcher has restarted this job: the largest of the counts the
    registered launchers set (torchrun's ``TORCHELASTIC_RESTART_COUNT``, SLURM's
    ``SLURM_RESTART_COUNT``; 0: the first run)."""
    from torchrig.clusters import CLUSTER_ENVIRONMENTS

    return CLUSTER_ENVIRONMENTS.restart_count()
