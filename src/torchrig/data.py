"""Prepared dataloaders: batches on the device, a resumable position, and sharding.

A prepared loader yields batches already on ``rig.device``. Shuffled (or distributed) loaders
get a :class:`ResumableSampler` whose order depends only on ``(seed, epoch)``, so a run resumed
from a checkpoint sees exactly the batches the uninterrupted run would have seen, and N
processes together see the same global batches as one process.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler

from torchrig.nested import move_batch


class ResumableSampler(Sampler[int]):
    """A permutation per ``(seed, epoch)``, split across ``num_replicas`` ranks, able to skip ahead.

    With ``num_replicas=R`` rank ``r`` takes every R-th index starting at ``r``, so the
    per-rank batches of one step together hold the same samples as the single-process batch
    of ``R`` times the size (the dataset is padded by repeating indices when it does not split
    evenly, unless ``drop_last``).
    """

    def __init__(
        self,
        data_source: Sized,
        *,
        shuffle: bool,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.data_source = data_source
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.skip = 0
        n = len(data_source)
        if drop_last and n % num_replicas:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        n = len(self.data_source)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.total_size > n:
            order += (order * math.ceil(self.total_size / n))[: self.total_size - n]
        order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def loader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """The keyword arguments ``loader`` was built with, other than its dataset, batching and
    sampling (workers, collate_fn, pinning...): what a rebuilt copy of it passes on."""
    kw: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kw["pin_memory_device"] = loader.pin_memory_device
    return kw


def rebuild_with_sampler(
    loader: DataLoader[Any], *, seed: int, num_replicas: int, rank: int, pin_memory: bool
) -> DataLoader[Any] | None:
    """The same loader with a :class:`ResumableSampler`; None when it cannot be rebuilt.

    Loaders with a custom batch sampler, an iterable dataset, or a sampler that is neither
    random nor sequential are left alone (their order is theirs to control).
    """
    bs = loader.batch_sampler
    if not isinstance(bs, BatchSampler) or type(bs) is not BatchSampler:
        return None
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        return None
    if isinstance(loader.sampler, RandomSampler) and (
        loader.sampler.replacement or loader.sampler._num_samples is not None
    ):
        return None
    sampler = ResumableSampler(
        loader.dataset,  # type: ignore[arg-type]
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        num_replicas=num_replicas,
        rank=rank,
        drop_last=bs.drop_last,
    )
    kw = loader_kwargs(loader)
    kw["pin_memory"] = kw["pin_memory"] or pin_memory
    return DataLoader(loader.dataset, batch_size=bs.batch_size, sampler=sampler, drop_last=bs.drop_last, **kw)


class RigDataLoader:
    """Wraps a DataLoader: yields batches on ``device`` and remembers its place for checkpoints.

    ``on_batch`` (optional) is called with the loader each time it yields a batch.

    ``len()``, ``dataset``, ``batch_size`` and ``sampler`` come from the wrapped loader. Each
    ``iter()`` starts a new epoch (``set_epoch`` is called for you); ``state_dict`` records the
    epoch and how many batches of it were consumed (and, for a :class:`ResumableSampler`, how
    many samples of the global order), and ``load_state_dict`` makes the next ``iter()``
    continue right after them, also under another number of processes or batch size.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        device: torch.device,
        seed: int = 0,
        on_batch: Callable[[RigDataLoader], Any] | None = None,
    ) -> None:
        self.loader = loader
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

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (normally counted for you)."""
        self._resume_at = (epoch, 0)

    def __iter__(self) -> Iterator[Any]:
        if self._resume_at is not None:
            self.epoch, skip = self._resume_at
            self._resume_at = None
        else:
            self.epoch, skip = self.epoch + 1, 0
        resuming_mid_epoch = skip > 0
        sampler = self.loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        if isinstance(sampler, ResumableSampler):
            sampler.skip = skip * (self.loader.batch_size or 1)
            self.batches_seen = skip
            skip = 0
        else:
            self.batches_seen = 0
        device = self.device
        non_blocking = device.type not in ("cpu", "mps")  # as move_to_device decides, once per epoch
        if resuming_mid_epoch:
            # DataLoader draws a base seed from torch's RNG when an epoch starts; the run being
            # resumed already made that draw (the restored RNG state is after it), so don't repeat it.
            with torch.random.fork_rng(devices=[]):
                it = iter(self.loader)
        else:
            it = iter(self.loader)
        try:
            for _ in range(skip):  # a loader we could not rebuild: skip by reading
                next(it)
                self.batches_seen += 1
            # A DataLoader makes its batches on the CPU: nothing to move there.
            move = self.move_batches and device.type != "cpu"
            on_batch = self.on_batch
            for batch in it:
                self.batches_seen += 1
                if on_batch is not None:
                    on_batch(self)
                yield move_batch(batch, device, non_blocking) if move else batch
        finally:
            if isinstance(sampler, ResumableSampler):
                sampler.skip = 0

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: ``epoch``, ``batches_seen`` (this rank's) and ``seed``.

        A loader with a :class:`ResumableSampler` also records ``samples_seen``, the samples
        of the epoch's global order that all ranks together consumed (``len(dataset)`` once the
        epoch is over), with the ``num_replicas`` and ``batch_size`` it ran with, so a run with
        another number of processes or batch size resumes at the same place in the data.
        """
        state: dict[str, Any] = {"epoch": self.epoch, "batches_seen": self.batches_seen, "seed": self.seed}
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableSampler):
            batch_size = self.loader.batch_size or 1
            n = len(sampler.data_source)
            if self.batches_seen >= len(self.loader):
                samples = n
            else:
                # rank r took global positions r, r+R, ...: the ranks together consumed a prefix
                samples = min(self.batches_seen * batch_size, sampler.num_samples) * sampler.num_replicas
            state.update(samples_seen=samples, num_replicas=sampler.num_replicas, batch_size=batch_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue right after the position in ``state`` at the next ``iter()``.

        A position saved by a different number of processes or batch size is converted through
        the global sample position; when it falls inside one of this loader's global batches,
        the resume starts at that batch and warns how many samples are seen again.
        """
        epoch, seen = int(state["epoch"]), int(state["batches_seen"])
        self.seed = int(state.get("seed", self.seed))
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableSampler):
            sampler.seed = self.seed
            if "samples_seen" in state and epoch >= 0:
                epoch, seen = self._batches_for(state, epoch, sampler)
        if epoch >= 0 and seen >= len(self.loader):
            epoch, seen = epoch + 1, 0
        self._resume_at = (max(epoch, 0), seen)
        self.epoch, self.batches_seen = epoch, seen

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
            warnings.warn(
                f"the checkpoint's dataloader stopped {samples} samples into epoch {epoch} "
                f"(saved with num_replicas={saved_replicas} x batch_size={saved_batch}); this run takes "
                f"{per_step} samples per step (num_replicas={replicas} x batch_size={batch_size}) and "
                f"{samples} is not a multiple of {per_step}, so it resumes at sample {skip * per_step} "
                f"and {again} samples will be seen again",
                stacklevel=3,
            )
        return epoch, skip
