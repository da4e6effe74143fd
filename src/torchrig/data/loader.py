"""The prepared loader (:class:`RigDataLoader`): the epoch, its RNG state, saving and resuming
its position, and reading a stream one batch ahead."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from torchrig.data.iterable import is_stateful, is_stateful_loader, keeps_position, shuffle_buffer
from torchrig.data.rebuild import loader_kwargs, order_sampler
from torchrig.data.samplers import ResumableSampler, ResumedIndices
from torchrig.nested import move_batch

#: The entries of a saved position that hold one value per rank (in rank order). A loader keeps
#: its rank's chunk of each list (one value, its own, when saved by as many processes as it runs
#: with) and saves the chunks of every rank joined in rank order: a list from another number of
#: processes is saved again as given.
_PER_RANK = ("epoch_rng", "loader_state", "generator_states")


def _chunk(values: list[Any], rank: int, world: int) -> list[Any]:
    """Rank ``rank``'s contiguous chunk of ``values`` split among ``world`` ranks (the chunks joined
    in rank order are ``values``; each is ``[values[rank]]`` when there are ``world`` of them)."""
    n = len(values)
    return values[rank * n // world : (rank + 1) * n // world]


def length_of(loader: Any) -> int | float:
    """``len(loader)``, or ``inf`` for one without a length (a DataLoader over an IterableDataset
    without ``__len__`` has ``__len__`` but raises TypeError)."""
    try:
        return len(loader) if isinstance(loader, Sized) else math.inf
    except TypeError:
        return math.inf


class RigDataLoader:
    """Wraps a DataLoader: yields batches on ``device`` and remembers its place for checkpoints.

    ``on_batch`` (optional) is called with the loader each time it yields a batch. ``strategy``
    (the preparing Rig's) gathers every rank's part of the state (each rank's RNG state and
    stream position); without one the loader is the only process.

    ``len()``, ``dataset``, ``batch_size`` and ``sampler`` come from the wrapped loader; ``len()``
    is always the whole epoch's, also in a resumed epoch. Each ``iter()`` starts a new epoch
    (``set_epoch`` is called for you) and records torch's RNG state at its start (the state the
    DataLoader draws its workers' seed and a random sampler its order from); ``state_dict``
    records that state, the epoch and how many batches of it were consumed (and, for a
    :class:`ResumableSampler`, how many samples of the global order), and ``load_state_dict``
    makes the next ``iter()`` draw the same epoch again and continue right after them, also
    under another number of processes or batch size.

    A map-style loader skips the consumed batches as indices: no sample of them is read. A loader
    over an ``IterableDataset`` in a ``torchdata`` StatefulDataLoader (what ``prepare`` makes of
    one whose dataset has ``state_dict``/``load_state_dict``) saves and restores the dataset's own
    position, in its workers too; any other iterable loader, and one whose dataset's state does
    not resume it (a Hugging Face stream shuffled with a buffer), reads the consumed batches again.

    With ``look_ahead`` (the Trainer sets it on its training loader under accumulation), an epoch
    of a loader without a length is read one batch ahead, so :attr:`at_last_batch` says, when a
    batch is given out, whether it is the epoch's last. The saved position stays the last batch
    given out: the batch read ahead is read again after a resume (a stateful stream's position is
    taken before it is read).

    The position :meth:`state_dict` saves has one source: this rank's part of it, kept while the
    loader's own progress (the epoch, the batches given out, a stream's own state) does not say
    it, else computed from that progress. It is kept

    - from :meth:`load_state_dict` until the next epoch starts (``iter()``), which consumes it
      (a stream's position goes to its StatefulDataLoader) and forgets it: until then nothing was
      consumed, and the state saved is the one loaded, as given;
    - while reading ahead, from each batch given out until the next: the position after that
      batch, taken before the batch after it is read;
    - from :meth:`end_workers` (the position where the unfinished epoch stopped) until the next
      epoch starts;
    - from the end of an epoch read to its end until the next epoch starts: that end, saved
      with ``ended`` (a stream's batches and own state cannot say it ended), so a resume from it
      gives nothing more of that epoch (a loader with a length resumes at the next one).

    ``set_epoch`` forgets it (the next ``iter()`` starts that epoch from its start). Twice in a
    row, :meth:`state_dict` gives the same position.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        device: torch.device,
        seed: int = 0,
        on_batch: Callable[[RigDataLoader], Any] | None = None,
        strategy: Any = None,
        shares: int = 1,
    ) -> None:
        self.loader = loader
        self.strategy = strategy
        #: How many shares a stream (an ``IterableDataset``) is split into, one per data-parallel
        #: process; 1: each process reads it whole; None: not a stream. Saved (as ``num_replicas``):
        #: a position inside one share does not resume another split.
        self.shares = shares if isinstance(loader.dataset, IterableDataset) else None
        self.device = device
        self.seed = seed
        self.epoch = -1
        self.batches_seen = 0
        #: Called with this loader each time it yields a batch, before the batch is handed out
        #: (the Rig that prepared the loader records it as its ``current_loader``).
        self.on_batch = on_batch
        #: False: yield the batches where the DataLoader made them (the Trainer's module moves
        #: them itself, in its ``transfer_batch_to_device`` hook).
        self.move_batches = True
        self._resume_at: tuple[int, int] | None = None
        #: torch's RNG state (and the loader's own generator's) when the current epoch started.
        self._epoch_rng: dict[str, Any] | None = None
        #: True: read an epoch without a length one batch ahead, to know its last batch.
        self.look_ahead = False
        #: The batches of an epoch the loop takes at most (the Trainer's ``limit_train_batches``,
        #: counted from the epoch's start): the look-ahead reads nothing past them.
        self.epoch_limit: float = math.inf
        #: Whether the batch last given out is the last of its epoch, as the look-ahead found
        #: (always False for a loader with a length, or without ``look_ahead``).
        self.at_last_batch = False
        #: This rank's part of the position to save (:meth:`state_dict`'s entries, each rank's
        #: ``epoch_rng`` and ``loader_state`` as this rank's chunk of the list), while the loader's progress
        #: does not say it; None: the progress says it. Set by :meth:`load_state_dict` (the state
        #: loaded: a position from another batch size is not rounded to this loader's batches),
        #: by reading ahead (the position before the batch read ahead), by :meth:`end_workers` and
        #: at an epoch's end; consumed and forgotten when the next epoch starts (the class
        #: docstring has the cycle).
        self._position: dict[str, Any] | None = None
        #: Said when the resumed epoch starts: samples of the loaded position seen again.
        self._seen_again: str | None = None
        #: An epoch was started and not read to its end (its iterator may hold worker processes).
        self._unfinished = False
        #: Whether this loader has made an iterator of the wrapped loader (a persistent one keeps it).
        self._iterated = False

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (normally counted for you)."""
        self._resume_at, self._position, self._seen_again = (epoch, 0), None, None

    def __iter__(self) -> Iterator[Any]:
        position, self._position = self._position, None  # consumed: the epoch starting now moves on from it
        if self._seen_again is not None:  # only a loader that runs the resumed epoch sees them again
            warnings.warn(self._seen_again, stacklevel=2)
            self._seen_again = None
        if self._resume_at is not None:
            self.epoch, skip = self._resume_at
            self._resume_at = None
        else:
            self.epoch, skip = self.epoch + 1, 0
        for order in (self.loader.sampler, self.loader.dataset):  # a Hugging Face stream's shuffle too
            set_epoch = getattr(order, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
        self.batches_seen = skip
        self._unfinished = True
        if skip:  # (a position to skip to was loaded: ``position`` is that state)
            loaded = position or {}
            # An epoch read to its end has nothing left, whatever a stream would give if read again
            # (a loader with a length resumes at its next epoch: nothing to skip there).
            own = loaded.get("loader_state") or [None]  # (this rank's chunk: its own value, as the count matched)
            it = iter(()) if loaded.get("ended") else self._resumed_epoch(skip, own[0])
        else:
            self._epoch_rng = {"torch": torch.get_rng_state(), "generator": None, **self._generator_states()}
            with self._no_second_base_seed(self.loader):
                it = iter(self.loader)
            self._iterated = True
        self.at_last_batch = False
        if self.look_ahead and math.isinf(length_of(self.loader)):
            it = self._read_ahead(it)
        device = self.device
        non_blocking = device.type not in ("cpu", "mps")  # as move_to_device decides, once per epoch
        move = self.move_batches and device.type != "cpu"  # a DataLoader makes its batches on the CPU
        on_batch = self.on_batch
        for batch in it:
            self.batches_seen += 1
            if on_batch is not None:
                on_batch(self)
            yield move_batch(batch, device, non_blocking) if move else batch
        # Read to its end: the position says so, also for a stream, whose batches and own state
        # do not (a resume from it gives nothing more of this epoch: the next starts afresh).
        self._position = {**self._here(self.batches_seen, None), "ended": True}
        self._unfinished = False

    def end_workers(self) -> None:
        """End now the worker processes of an epoch that was not read to its end (a fit stopped
        mid-epoch by ``max_steps`` or a stop signal); :meth:`state_dict` still gives where it stopped.

        A torchdata StatefulDataLoader keeps its iterator, and the iterator its workers, until the
        loader itself is freed. A loader held in a reference cycle (a Trainer's is) is freed by
        the garbage collector at some later moment, where torch's shutdown then waits 5 s for each
        worker (the queue that would tell it to stop is closed first). The Trainer calls this as
        each stage ends. A plain DataLoader needs none of it: its iterator ends with the epoch's
        (unless ``persistent_workers``, which keeps them for the loader's life, as asked).
        """
        loader = self.loader
        if not (self._unfinished and is_stateful_loader(loader) and loader.num_workers > 0):
            return
        if self._position is None:  # (reading ahead, the position is the one before the batch read ahead)
            own = loader.state_dict() if self._keeps_stream_position() else None  # type: ignore[attr-defined]
            self._position = self._here(self.batches_seen, own)
        loader.load_state_dict({})  # type: ignore[attr-defined]  # drops its iterator, the workers' last holder
        self._unfinished = False

    def _read_ahead(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it``'s batches, each given out once the next one is read (or the epoch has ended,
        or reached :attr:`epoch_limit`: then :attr:`at_last_batch` is set). A stateful stream's
        position is taken before the next batch is read, so a checkpoint holds the position after
        the batch given out."""
        position = self.loader.state_dict if self._keeps_stream_position() else None  # type: ignore[attr-defined]
        try:
            batch = next(it)
        except StopIteration:
            return
        while True:
            # (this batch is counted once given out: the position after it has one batch more)
            after = None if position is None else self._here(self.batches_seen + 1, position())
            if self.batches_seen + 1 >= self.epoch_limit:
                self.at_last_batch = True  # the last the loop takes: the batch after it stays unread
            else:
                try:
                    following = next(it)
                except StopIteration:
                    self.at_last_batch = True
            self._position = after
            yield batch
            if self.at_last_batch:
                return
            batch = following

    def _resumed_epoch(self, skip: int, loader_state: dict[str, Any] | None) -> Iterator[Any]:
        """The current epoch after its first ``skip`` batches, drawn as the epoch first was
        (a stream in a StatefulDataLoader continues from ``loader_state``, its saved position).

        Torch's RNG is set to the epoch's starting state while the epoch's iterator starts (the
        workers' seed and a random sampler's order are drawn then) and given back after, so the
        RNG stream of the run continues from the checkpoint's state."""
        loader, rng = self.loader, self._epoch_rng
        if rng is not None:
            self._set_generator_states(rng)
        with torch.random.fork_rng(devices=[]):
            if rng is not None and rng.get("torch") is not None:
                torch.set_rng_state(rng["torch"].cpu())
            # Without the epoch's state (a checkpoint from before it was saved), the DataLoader's
            # draw is not repeated: the restored RNG state is already after it.
            if isinstance(loader.dataset, IterableDataset):
                if loader_state is not None and self._keeps_stream_position():  # the dataset's (workers') own
                    loader.load_state_dict(loader_state)  # type: ignore[attr-defined]
                    return iter(loader)
                self._warn_replay(skip)
                it = iter(loader)
                for _ in range(skip):  # no index to skip, no position: read the consumed batches again
                    next(it)
                return it
            batches = loader.batch_sampler
            indices = ResumedIndices(loader.sampler if batches is None else batches, skip)
            kw = loader_kwargs(loader)
            if self._keeps_workers(loader):  # (its base seed, drawn from a generator of its own)
                kw["generator"] = torch.Generator().manual_seed(self.seed + self.epoch)
            if batches is not None:
                one_epoch = DataLoader(loader.dataset, batch_sampler=indices, **kw)
            else:
                one_epoch = DataLoader(loader.dataset, sampler=indices, batch_size=None, **kw)
            it = iter(one_epoch)
            indices.start()  # the order is drawn here, from the epoch's state
            return it

    def _keeps_workers(self, loader: DataLoader[Any]) -> bool:
        """Whether an iterator of ``loader`` made now draws a base seed the run never stopped did not
        draw: its workers are persistent, and this epoch, not the run's first, is the first this
        process reads (a resumed run). torch draws the workers' base seed from torch's RNG (or the
        loader's generator) when it makes a loader's iterator, not when a persistent one starts its
        next epoch; a draw there would move the RNG an order is then drawn from (a
        ``WeightedRandomSampler``, a batch sampler's ``randperm``) away from the run never stopped."""
        return loader.persistent_workers and loader.num_workers > 0 and self.epoch > 0 and not self._iterated

    @contextlib.contextmanager
    def _no_second_base_seed(self, loader: DataLoader[Any]) -> Iterator[None]:
        """While ``iter(loader)`` makes its iterator: when :meth:`_keeps_workers`, the base seed is
        drawn from a generator of its own (seeded by the run's seed and the epoch), not from torch's
        RNG or the loader's generator, whose states are the run never stopped's for this epoch."""
        if not self._keeps_workers(loader):
            yield
            return
        own, loader.generator = loader.generator, torch.Generator().manual_seed(self.seed + self.epoch)
        try:
            yield
        finally:
            loader.generator = own

    def _generators(self) -> dict[str, torch.Generator]:
        """The generators the loader draws from besides torch's: its own (``generator``, the
        workers' base seed and a ``shuffle=True`` order) and :meth:`_own_generators`."""
        generator = self.loader.generator
        return {**({} if generator is None else {"generator": generator}), **self._own_generators()}

    def _generator_states(self) -> dict[str, torch.Tensor]:
        return {key: generator.get_state() for key, generator in self._generators().items()}

    def _set_generator_states(self, states: dict[str, Any]) -> None:
        # (.cpu(): a checkpoint loaded with map_location on an accelerator brings the states there)
        for key, generator in self._generators().items():
            if states.get(key) is not None:
                generator.set_state(states[key].cpu())

    def _own_generators(self) -> dict[str, torch.Generator]:
        """The generators the loader's index order draws from, other than the loader's own
        ``generator=``: its sampler's (a :class:`ResumableSampler` honouring a ``RandomSampler``'s,
        a ``WeightedRandomSampler(..., generator=g)``, ``SubsetRandomSampler``, ``RandomSampler``
        with replacement..., also inside torch's ``BatchSampler``) as ``sampler_generator``, and a
        batch sampler's own ``generator`` as ``batch_sampler_generator``. Their states are saved with
        the epoch's, so a resumed epoch draws its order again from the states it started with."""
        loader = self.loader
        found = {"sampler_generator": order_sampler(loader), "batch_sampler_generator": loader.batch_sampler}
        own: dict[str, torch.Generator] = {}
        for key, holder in found.items():
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator) and all(
                generator is not g for g in (loader.generator, *own.values())
            ):
                own[key] = generator
        return own

    def _shared_generator_states(self, rngs: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """From every rank's ``epoch_rng`` saved by another number of processes, what still serves
        this rank: the state of the generator a :class:`ResumableSampler` draws its order from
        (``sampler_generator``, or ``generator`` when it is the loader's own), the same on every
        rank (prepare made it so); torch's per-rank states do not. None when there is none."""
        sampler = self.loader.sampler
        if not rngs or not isinstance(sampler, ResumableSampler) or sampler.generator is None:
            return None
        key = "generator" if sampler.generator is self.loader.generator else "sampler_generator"
        return {key: rngs[0][key]} if rngs[0].get(key) is not None else None

    def _every_rank(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (a collective when there are several)."""
        return [value] if self.strategy is None else list(self.strategy.all_gather_object(value))

    def _warn_replay(self, skip: int) -> None:
        dataset = self.loader.dataset
        name = type(dataset).__name__
        buffer = shuffle_buffer(dataset)
        if buffer is not None:
            why = (
                f"its state does not hold its shuffle buffer (shuffle(buffer_size={buffer}): datasets saves the "
                "stream's position, not the examples waiting in the buffer), so the epoch is replayed from its start "
                "to give the same examples in the same order"
            )
            fix = "shuffle a map-style datasets.Dataset instead (DataLoader(shuffle=True) resumes it by index)"
        else:
            why = f"{name} keeps no position torchrig can save"
            fix = (
                "install torchdata (prepare() then runs it in a StatefulDataLoader, which saves that position)"
                if is_stateful(dataset)
                else "give it state_dict() and load_state_dict() (its position in the stream; docs/data.md shows how)"
            )
        warnings.warn(
            f"resuming the {name} of this loader reads the {skip} batches it already trained on again and throws "
            f"them away, as {why}; to resume without reading them, {fix}",
            stacklevel=4,
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: ``epoch``, ``batches_seen`` (this rank's), ``seed``
        and ``epoch_rng`` (each rank's RNG state when the epoch started, and the loader's
        generator's: a collective when there are several processes).

        A loader with a :class:`ResumableSampler` also records ``samples_seen``, the samples
        of the epoch's global order that all ranks together consumed (``len(dataset)`` once the
        epoch is over), with the ``num_replicas`` and ``batch_size`` it ran with, so a run with
        another number of processes or batch size resumes at the same place in the data. A
        stream in a StatefulDataLoader records ``loader_state``, each rank's position in it; a
        stream split across processes records ``num_replicas``, its number of shares.
        Between ``load_state_dict`` and the next ``iter()`` it is the state loaded, as given
        (every rank's ``epoch_rng``, also from another number of processes: each rank keeps its
        chunk of the list, and the chunks joined in rank order are the list loaded).
        """
        local = self._position
        if local is None:  # the progress says it: the batches given out, a stream's own state
            position = None
            if self._keeps_stream_position():
                with torch.random.fork_rng(devices=[]):  # it may start an iterator (a draw) when none is running
                    position = self.loader.state_dict()  # type: ignore[attr-defined]
            local = self._here(self.batches_seen, position)
        return {
            key: [v for chunk in self._every_rank(value) for v in chunk] if key in _PER_RANK else value
            for key, value in local.items()
        }

    def _keeps_stream_position(self) -> bool:
        """Whether the loader is a StatefulDataLoader over a stream whose own state resumes it (not
        one shuffled with a buffer it does not save): the state saves its position."""
        dataset = self.loader.dataset
        return isinstance(dataset, IterableDataset) and is_stateful_loader(self.loader) and keeps_position(dataset)

    def _here(self, batches_seen: int, loader_state: dict[str, Any] | None) -> dict[str, Any]:
        """This rank's part of the position after ``batches_seen`` batches of the current epoch,
        a stream's being ``loader_state`` (None: the loader keeps none)."""
        state: dict[str, Any] = {"epoch": self.epoch, "batches_seen": batches_seen, "seed": self.seed}
        if self._epoch_rng is not None:
            state["epoch_rng"] = [self._epoch_rng]
        now = self._generator_states()
        if now:  # (where the next epoch's order starts: one read to its end has moved them on)
            state["generator_states"] = [now]
        if loader_state is not None:
            state["loader_state"] = [loader_state]
        if self.shares is not None:
            state["num_replicas"] = self.shares
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableSampler):
            batch_size = self.loader.batch_size or 1
            n = len(sampler.data_source)
            if batches_seen >= len(self.loader):
                samples = n
            else:
                # rank r took global positions r, r+R, ...: the ranks together consumed a prefix
                samples = min(batches_seen * batch_size, sampler.num_samples) * sampler.num_replicas
            state.update(samples_seen=samples, num_replicas=sampler.num_replicas, batch_size=batch_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue right after the position in ``state`` at the next ``iter()``.

        A position saved by a different number of processes or batch size is converted through
        the global sample position; when it falls inside one of this loader's global batches,
        the resume starts at that batch and warns how many samples are seen again. A stream's
        position saved by another number of processes is refused (ValueError), and changes nothing:
        a stream with a position, and one replayed that is split across processes (one each
        process reads whole resumes under any number). Each rank's ``epoch_rng`` is used only when
        saved by as many processes as this run has.
        """
        epoch, seen = int(state["epoch"]), int(state["batches_seen"])
        rank, world = (0, 1) if self.strategy is None else (self.strategy.global_rank, self.strategy.world_size)
        self._check_split(state, world)
        # This rank's part of the state, kept (and saved again as it is) until the next epoch starts.
        local = {key: value for key, value in state.items() if key not in _PER_RANK}
        for key in _PER_RANK:
            if state.get(key):
                local[key] = _chunk(list(state[key]), rank, world)
        self._position, self._seen_again = local, None
        self.seed = int(state.get("seed", self.seed))
        rngs = state.get("epoch_rng") or []
        self._epoch_rng = rngs[rank] if len(rngs) == world else self._shared_generator_states(rngs)
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableSampler):
            sampler.seed = self.seed
        if isinstance(sampler, ResumableSampler) and "samples_seen" in state and epoch >= 0:
            epoch, seen = self._batches_for(state, epoch, sampler)
        if epoch >= 0 and seen >= length_of(self.loader):
            epoch, seen = epoch + 1, 0
        nows = state.get("generator_states") or []
        if epoch > int(state["epoch"]) and len(nows) == world:
            # Resumed at the start of the next epoch: the generators of the order go on from their
            # states when it was saved, after the saved epoch drew from them (its start's would draw it again).
            self._set_generator_states(nows[rank])
        self._resume_at = (max(epoch, 0), seen)
        self.epoch, self.batches_seen = epoch, seen

    def _check_split(self, state: dict[str, Any], world: int) -> None:
        """ValueError when ``state`` holds a stream's position in another split of the stream than
        this run's: each rank's own position (``loader_state``) from another number of processes, or
        a replayed stream split into another number of shares (``num_replicas``: 1 for a stream
        each process reads whole, which so resumes under any number of processes that read it
        whole; a checkpoint from before it was saved is not checked)."""
        if self.shares is None:
            return  # (a map-style loader's ``num_replicas`` is converted through the global sample position)
        positions = state.get("loader_state")
        saved, now = state.get("num_replicas", self.shares), self.shares
        if positions is not None and is_stateful_loader(self.loader) and len(positions) != world:
            saved, now = len(positions), world
        if saved != now:
            processes = f"{saved} process{'es' if saved != 1 else ''}"
            raise ValueError(
                f"the checkpoint's {type(self.loader.dataset).__name__} stream was saved by {processes}, each at "
                f"its own position in its share of the stream; this run has {now}. Resume it with {processes}: "
                "a position in one share of a stream does not say where another number of shares would be"
            )

    def _batches_for(self, state: dict[str, Any], epoch: int, sampler: ResumableSampler) -> tuple[int, int]:
        """``(epoch, batches of this rank to skip)`` for the global position saved in ``state``."""
        samples = int(state["samples_seen"])
        if samples >= len(sampler.data_source):
            return epoch + 1, 0
        batch_size, replicas = self.loader.batch_size or 1, sampler.num_replicas
        per_step = batch_size * replicas
        skip, again = divmod(samples, per_step)
        if again and skip < len(self.loader):
            saved_replicas, saved_batch = state.get("num_replicas", "?"), state.get("batch_size", "?")
            self._seen_again = (
                f"the checkpoint's dataloader stopped {samples} samples into epoch {epoch} "
                f"(saved with num_replicas={saved_replicas} x batch_size={saved_batch}); this run takes "
                f"{per_step} samples per step (num_replicas={replicas} x batch_size={batch_size}) and "
                f"{samples} is not a multiple of {per_step}, so it resumes at sample {skip * per_step} "
                f"and {again} samples will be seen again"
            )
        return epoch, skip
