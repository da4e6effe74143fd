"""Prepared dataloaders: batches on the device, an exact resumable position, and sharding.

A prepared loader yields batches already on ``rig.device``. Shuffled (or distributed) loaders
get a :class:`ResumableSampler` whose order depends only on ``(seed, epoch)``, so N processes
together see the same global batches as one process; every loader records where its epoch
started and how far it got, so a run resumed from a checkpoint sees exactly the batches the
uninterrupted run would have seen (docs/data.md says what is exact for each kind of pipeline).

- ``samplers``: the index orders (:class:`ResumableSampler`, the skipped rest of an epoch);
- ``iterable``: iterable datasets: their position through torchdata's StatefulDataLoader, and
  each process's share of a stream;
- ``rebuild``: rebuilding a user's DataLoader with a :class:`ResumableSampler`;
- ``loader``: :class:`RigDataLoader`, the epoch, its RNG state, saving and resuming its position.
"""

from torchrig.data.iterable import SHARD_HOOK, rebuild_iterable
from torchrig.data.loader import RigDataLoader, length_of
from torchrig.data.rebuild import loader_kwargs, order_sampler, rebuild_with_sampler, sampler_generator
from torchrig.data.samplers import ResumableSampler, ResumedIndices

__all__ = [
    "SHARD_HOOK",
    "ResumableSampler",
    "ResumedIndices",
    "RigDataLoader",
    "length_of",
    "loader_kwargs",
    "order_sampler",
    "rebuild_iterable",
    "rebuild_with_sampler",
    "sampler_generator",
]
