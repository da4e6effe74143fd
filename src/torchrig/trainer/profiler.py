"""Where a fit's time goes: ``Trainer(profiler="simple" | "pytorch" | a Profiler)``.

A profiler is chosen once per fit. With ``profiler=None`` (the default) the training loop runs
exactly the calls it runs without this module: the batch runner only wraps its callables (the
data iterator, ``training_step``, the backward, the optimizer steps, the step's logging, the
validation and the callbacks' hooks) when a profiler is set, so the same loop body runs either
way and an unprofiled step pays nothing for the feature.

* :class:`SimpleProfiler` (``"simple"``): wall time per phase, as a share of the fit's
  training time, and the slowest callback hooks, printed as a table when the fit ends.
* :class:`PyTorchProfiler` (``"pytorch"``): ``torch.profiler`` over a window of steps; a Chrome
  trace and a TensorBoard trace in the run directory, and the top operators by self time.
"""

from __future__ import annotations

import io
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchrig import arguments
from torchrig.devices import device_module

if TYPE_CHECKING:
    from torchrig.trainer.trainer import Trainer

__all__ = ["PHASES", "Profiler", "PyTorchProfiler", "SimpleProfiler", "resolve_profiler"]

#: The phases of a training step, in the order the table shows them. ``other`` is what no timed
#: call covers (the loop itself, the module's epoch hooks, epoch-end logging, scheduler steps by epoch).
DATA, STEP, BACKWARD, OPTIMIZER = "data loading", "training_step (forward)", "backward", "optimizer step"
CALLBACKS, LOGGING, VALIDATION, CHECKPOINTING = "callbacks", "logging", "validation", "checkpointing"
PHASES = (DATA, STEP, BACKWARD, OPTIMIZER, CALLBACKS, LOGGING, VALIDATION, CHECKPOINTING)
OTHER = "other"
#: Phases whose calls never contain another timed call (SimpleProfiler times them more cheaply).
_LEAVES = frozenset((DATA, STEP, BACKWARD, OPTIMIZER, LOGGING))


class Profiler:
    """What the Trainer asks of a profiler; subclass it for your own.

    The Trainer calls :meth:`start` when the first training epoch is about to start, wraps the
    callables of the training loop with :meth:`wrap` and :meth:`wrap_batches` (once per epoch,
    never per batch) and the callbacks' hooks with :meth:`wrap` (once per fit), and calls
    :meth:`stop` after the last epoch (also when the fit stops early or raises). The default methods
    change nothing.
    """

    def start(self, trainer: Trainer) -> None:
        """The fit's first training epoch is about to start."""

    def stop(self, trainer: Trainer) -> None:
        """The fit's training loop ended; report here."""

    def wrap(self, phase: str, fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
        """``fn`` as the loop should call it; ``phase`` is one of :data:`PHASES`, ``name`` names a hook."""
        return fn

    def wrap_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The training batches of one epoch; each ``next`` starts a step."""
        return batches

    def wrap_hooks(self, hooks: list[Callable[..., Any]]) -> list[Callable[..., Any]]:
        """Callback hooks (bound methods), each wrapped with :meth:`wrap` under its name
        (``ProgressBar.on_train_batch_end``); a ``ModelCheckpoint``'s count as checkpointing."""
        from torchrig.trainer.checkpointing import ModelCheckpoint

        wrapped = []
        for hook in hooks:
            owner = getattr(hook, "__self__", None)
            name = f"{type(owner).__name__}.{getattr(hook, '__name__', 'hook')}" if owner is not None else repr(hook)
            wrapped.append(self.wrap(CHECKPOINTING if isinstance(owner, ModelCheckpoint) else CALLBACKS, hook, name))
        return wrapped


def resolve_profiler(value: Any) -> Profiler | None:
    """The Trainer's ``profiler=`` argument: None, ``"simple"``, ``"pytorch"`` or a Profiler."""
    if value is None or isinstance(value, Profiler):
        return value
    if isinstance(value, str) and value.strip().lower() in _BY_NAME:
        return _BY_NAME[value.strip().lower()]()
    shown = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
    raise ValueError(
        f"profiler={shown}: use None, 'simple', 'pytorch' or a torchrig.Profiler object "
        "(SimpleProfiler(), PyTorchProfiler(wait=1, warmup=1, active=3))"
    )


def _device_sync(device: torch.device) -> Callable[[], None] | None:
    """``torch.<device type>.synchronize`` for an accelerator (None on the CPU or without one)."""
    if device.type == "cpu":
        return None
    sync = getattr(device_module(device.type), "synchronize", None)
    return sync if callable(sync) else None


def rendered(renderable: Any, width: int = 110) -> str:
    """A rich renderable as plain text (printed with ``rig.print`` on rank zero only)."""
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False, color_system=None).print(renderable)
    return out.getvalue()


class SimpleProfiler(Profiler):
    """Wall time of each phase of the training steps, printed as a table when the fit ends.

    The table gives, for each phase (data loading, ``training_step`` with the forward, backward,
    optimizer step with clipping and per-step schedulers, callbacks, logging, validation,
    checkpointing, and ``other`` for what no timed call covers), its total seconds, its
    milliseconds per step and its share of the total, then the slowest callback hooks. The
    total is the wall time from the first step's start to the end of the last epoch: the sum of
    the times between consecutive step starts, epoch ends included. A phase's time excludes the
    phases timed inside it (a checkpoint saved during validation counts as checkpointing).

    On an accelerator each timed call ends with a device synchronisation (``sync_device=True``,
    the default there): without it a phase's wall time is the time to launch its kernels, and
    the wait lands in whichever phase synchronises next (usually the logging or the next data
    transfer). Synchronising is a profiling mode: it removes the overlap of host and device
    work, so the profiled step can be slower than an unprofiled one; pass ``sync_device=False``
    to time the launches instead. On the CPU nothing is synchronised. Its own cost is a clock
    read pair per timed call (six a step with one optimizer, plus one per callback hook called
    each batch): about 2 µs a step warm (docs/trainer_tools.md has the measurements).

    Results, after a fit: :attr:`phase_seconds` (phase -> seconds), :attr:`hook_seconds`
    (hook -> seconds, calls), :attr:`total_seconds`, :attr:`steps`.

    Args:
        sync_device: synchronise the device after each timed call (None: on accelerators only).
        hooks_shown: how many of the slowest hooks the report names.

    Example:
        >>> # trainer = Trainer(profiler="simple")          # or profiler=SimpleProfiler(sync_device=False)
        >>> # trainer.fit(module, loader)                    # prints the table when the fit ends
    """

    def __init__(self, *, sync_device: bool | None = None, hooks_shown: int = 5) -> None:
        if sync_device not in (None, True, False):
            raise ValueError(f"sync_device={sync_device!r}; use True, False or None (on accelerators only)")
        arguments.int_in_range("hooks_shown", hooks_shown, 0)
        self.sync_device, self.hooks_shown = sync_device, hooks_shown
        self._slots: dict[str, list[float]] = {}  # phase or hook -> [seconds, calls]
        self._hooks: dict[str, str] = {}  # hook slot -> its phase
        self._inner = 0.0  # seconds of timed calls inside the running one (nested calls)
        self._sync: Callable[[], None] | None = None
        self._started = 0.0
        self._first_step = 0
        self.phase_seconds: dict[str, float] = {}
        self.hook_seconds: dict[str, tuple[float, int]] = {}
        self.total_seconds = 0.0
        self.steps = 0

    def start(self, trainer: Trainer) -> None:
        for slot in self._slots.values():  # what was timed before (the sanity check) does not count
            slot[0] = slot[1] = 0.0
        self._inner = 0.0
        sync = self.sync_device
        self._sync = _device_sync(trainer.rig.device) if sync is None or sync else None
        self._first_step = trainer.global_step
        self._started = time.perf_counter()

    def _slot(self, key: str) -> list[float]:
        return self._slots.setdefault(key, [0.0, 0.0])

    def wrap(self, phase: str, fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
        slot = self._slot(phase if name is None else name)
        if name is not None:
            self._hooks[name] = phase
        clock, profiler = time.perf_counter, self
        if phase in _LEAVES:  # the step's own phases call no timed code: the leaner wrapper
            sync = self._sync  # wrapped per epoch, after start()

            def leaf(*args: Any) -> Any:
                began = clock()
                try:
                    return fn(*args)
                finally:
                    if sync is not None:
                        sync()
                    took = clock() - began
                    slot[0] += took
                    profiler._inner += took  # for a timed call around it, if any

            return leaf

        def timed(*args: Any) -> Any:
            outer, profiler._inner = profiler._inner, 0.0
            began = clock()
            try:
                return fn(*args)
            finally:
                sync = profiler._sync
                if sync is not None:
                    sync()
                took = clock() - began
                slot[0] += took - profiler._inner  # its own time: the timed calls inside count apart
                slot[1] += 1
                profiler._inner = outer + took

        return timed

    def wrap_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        return _TimedBatches(batches, self)

    def stop(self, trainer: Trainer) -> None:
        self.total_seconds = time.perf_counter() - self._started
        self.steps = trainer.global_step - self._first_step
        phases = dict.fromkeys(PHASES, 0.0)
        hooks: dict[str, tuple[float, int]] = {}
        for key, (seconds, calls) in self._slots.items():
            phase = self._hooks.get(key)
            if phase is None:
                phases[key] = phases.get(key, 0.0) + seconds
            else:
                phases[phase] += seconds
                if calls:  # called during the fit (hooks are wrapped once per run, some before it)
                    hooks[key] = (seconds, int(calls))
        phases[OTHER] = max(0.0, self.total_seconds - sum(phases.values()))
        self.phase_seconds = phases
        self.hook_seconds = dict(sorted(hooks.items(), key=lambda item: -item[1][0]))
        trainer.rig.print(self.report(), end="")

    def report(self) -> str:
        """The table of the last fit (what :meth:`stop` prints)."""
        from rich.table import Table

        total, steps = self.total_seconds, max(self.steps, 1)
        synced = " (device synchronised per phase)" if self._sync is not None else ""
        table = Table(
            title=f"SimpleProfiler: {self.steps} steps in {total:.3f} s, {1e3 * total / steps:.3f} ms a step{synced}"
        )
        for column in ("phase", "total s", "ms / step", "% of total"):
            table.add_column(column, justify="left" if column == "phase" else "right")
        for phase, seconds in self.phase_seconds.items():
            share = 100 * seconds / total if total > 0 else 0.0
            table.add_row(phase, f"{seconds:.4f}", f"{1e3 * seconds / steps:.4f}", f"{share:.1f}%")
        table.add_row("total", f"{total:.4f}", f"{1e3 * total / steps:.4f}", "100.0%", style="bold")
        text = rendered(table)
        slowest = list(self.hook_seconds.items())[: self.hooks_shown]
        if slowest:
            hooks = Table(title="Slowest hooks")
            for column in ("hook", "phase", "calls", "total s", "ms / call"):
                hooks.add_column(column, justify="left" if column in ("hook", "phase") else "right")
            for name, (seconds, calls) in slowest:
                per_call = 1e3 * seconds / calls if calls else 0.0
                hooks.add_row(name, self._hooks[name], str(calls), f"{seconds:.4f}", f"{per_call:.4f}")
            text += rendered(hooks)
        return text


class _TimedBatches:
    """An epoch's batch iterator whose ``next`` is timed as data loading (one Python call a batch)."""

    __slots__ = ("_next", "_profiler", "_slot", "_sync")

    def __init__(self, batches: Iterator[Any], profiler: SimpleProfiler) -> None:
        self._next, self._profiler = batches.__next__, profiler
        self._slot, self._sync = profiler._slot(DATA), profiler._sync

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        began = time.perf_counter()
        try:
            return self._next()
        finally:
            if self._sync is not None:
                self._sync()
            took = time.perf_counter() - began
            self._slot[0] += took
            self._profiler._inner += took


def _batches_through(next_batch: Callable[[], Any]) -> Iterator[Any]:
    """The batches ``next_batch()`` gives until it raises StopIteration (the loop closes the
    loader's own iterator, not this one)."""
    while True:
        try:
            batch = next_batch()
        except StopIteration:
            return
        yield batch


class PyTorchProfiler(Profiler):
    """``torch.profiler`` over a window of training steps.

    The schedule counts training steps (one ``next`` of the training loader each): the first
    ``skip_first`` steps are left alone, then ``wait`` steps pass unprofiled, ``warmup`` steps are
    profiled and thrown away (the profiler's own start-up cost), and ``active`` steps are
    recorded; ``repeat`` such cycles (default 1). The phases of each step show as labelled ranges
    (``training_step (forward)``, ``backward``, ``optimizer step``, ...).

    When the window ends each process writes, into ``<run dir>/profiler`` (rank zero's run
    directory: the logger's, else ``default_root_dir``; or ``dirpath``), a TensorBoard trace
    (``torch.profiler.tensorboard_trace_handler``: ``tensorboard/<worker>.*.pt.trace.json``, for
    the TensorBoard profiler plugin) and a Chrome trace ``chrome_trace_rank<R>.json`` (open it
    in ``chrome://tracing`` or https://ui.perfetto.dev). Global rank zero prints the top
    ``row_limit`` operators by self time (CPU, or the device's when it was profiled). A fit with
    fewer steps than ``skip_first + wait + warmup + active`` records nothing and says so.

    Args:
        wait, warmup, active, repeat, skip_first: the schedule (``torch.profiler.schedule``).
        dirpath: where to write the traces (default ``<run dir>/profiler``).
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
        row_limit: operators in the printed table.

    Example:
        >>> # trainer = Trainer(profiler=PyTorchProfiler(wait=1, warmup=1, active=3), max_steps=20)
    """

    def __init__(
        self,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        dirpath: str | Path | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        row_limit: int = 15,
    ) -> None:
        from torchrig import arguments

        self.wait = arguments.int_in_range("wait", wait, 0)
        self.warmup = arguments.int_in_range("warmup", warmup, 0)
        self.active = arguments.int_in_range("active", active, 1)
        self.repeat = arguments.int_in_range("repeat", repeat, 1)
        self.skip_first = arguments.int_in_range("skip_first", skip_first, 0)
        self.row_limit = arguments.int_in_range("row_limit", row_limit, 1)
        self.dirpath = None if dirpath is None else Path(arguments.path("dirpath", dirpath))
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self._profile: Any = None
        self._steps = 0
        self.output_dir: Path | None = None
        self.chrome_traces: list[Path] = []
        self.table = ""

    def start(self, trainer: Trainer) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.chrome_traces, self.table = [], ""
        if self.dirpath is not None:
            self.output_dir = self.dirpath
        else:  # rank zero's run directory, on every rank (a collective, as start() is called on every rank)
            from torchrig.trainer.checkpointing import default_checkpoint_dir

            self.output_dir = default_checkpoint_dir(trainer).parent / "profiler"
        activities = [ProfilerActivity.CPU]
        if trainer.rig.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        rank = trainer.rig.global_rank
        tensorboard = self.output_dir / "tensorboard"
        to_tensorboard = tensorboard_trace_handler(str(tensorboard), worker_name=f"rank{rank}")

        def ready(prof: Any) -> None:
            # A trace can be saved once: the TensorBoard handler writes it, the Chrome trace is a copy.
            before = set(tensorboard.glob(f"rank{rank}.*.pt.trace.json*"))
            to_tensorboard(prof)
            written = sorted(set(tensorboard.glob(f"rank{rank}.*.pt.trace.json*")) - before)
            path = self.output_dir / f"chrome_trace_rank{rank}.json"  # type: ignore[operator]
            if self.chrome_traces:  # a later cycle: its own file
                path = path.with_name(f"chrome_trace_rank{rank}_{len(self.chrome_traces)}.json")
            if written:
                shutil.copyfile(written[-1], path)
                self.chrome_traces.append(path)

        self._profile = profile(
            activities=activities,
            schedule=schedule(
                wait=self.wait,
                warmup=self.warmup,
                active=self.active,
                repeat=self.repeat,
                skip_first=self.skip_first,
            ),
            on_trace_ready=ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profile.start()
        self._steps = 0

    def wrap(self, phase: str, fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
        from torch.profiler import record_function

        label = phase if name is None else name

        def labelled(*args: Any) -> Any:
            with record_function(label):
                return fn(*args)

        return labelled

    def wrap_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        profiler = self

        def next_batch() -> Any:
            if profiler._steps:  # a step ended: move the schedule on
                profiler._profile.step()
            profiler._steps += 1
            with torch.profiler.record_function(DATA):
                return next(batches)

        return _batches_through(next_batch)

    def stop(self, trainer: Trainer) -> None:
        prof, self._profile = self._profile, None
        if prof is None:
            return
        prof.stop()  # inside the active steps: the window so far is written (a step() could open a new one)
        if not self.chrome_traces:
            needed = self.skip_first + self.wait + self.warmup + self.active
            trainer.rig.print(
                f"PyTorchProfiler: recorded nothing: the fit ran {self._steps} steps, the schedule needs "
                f"{needed} (skip_first={self.skip_first}, wait={self.wait}, warmup={self.warmup}, "
                f"active={self.active})"
            )
            return
        sort_by = "self_cuda_time_total" if trainer.rig.device.type == "cuda" else "self_cpu_time_total"
        self.table = prof.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        trainer.rig.print(
            f"PyTorchProfiler: top {self.row_limit} operators by self time (traces in {self.output_dir}):\n{self.table}"
        )


_BY_NAME: dict[str, Callable[[], Profiler]] = {"simple": SimpleProfiler, "pytorch": PyTorchProfiler}
