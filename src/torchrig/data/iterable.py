"""Iterable datasets in prepared loaders: their own position (``state_dict``) kept through
``torchdata``'s :class:`~torchdata.stateful_dataloader.StatefulDataLoader` (worker state
included), and a share of the stream per process.

A dataset says how to split itself across processes with the hook ``shard_for_rank(rank,
world_size)`` (returning the dataset this rank reads); a Hugging Face ``datasets.IterableDataset``
is split by ``datasets.distributed.split_dataset_by_node``.

A dataset keeps a position only when its own state resumes it where it stopped: a Hugging Face
stream shuffled with a buffer (``.shuffle(buffer_size=...)``) does not, as ``datasets`` saves its
position but not the examples waiting in the buffer; it runs in a plain DataLoader and its
resumed epoch is read again from its start (see :func:`shuffle_buffer`).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

#: The method an iterable dataset defines to be split across processes: ``shard_for_rank(rank,
#: world_size)`` returns the dataset rank ``rank`` of ``world_size`` reads (disjoint shares whose
#: union is the stream).
SHARD_HOOK = "shard_for_rank"


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` keeps a position: callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def shuffle_buffer(dataset: Any) -> int | None:
    """The size of the shuffle buffer of a Hugging Face stream shuffled with one
    (``.shuffle(buffer_size=...)``, also when mapped, filtered, batched or split after), or None.

    ``datasets`` saves such a stream's position in its ``state_dict`` but not the examples waiting
    in the buffer: resumed from that state, the buffer is refilled from the position, so the
    examples it held are lost for the epoch and the order after the stop differs. The buffer is
    seen only in the stream's chain of examples iterables (``_ex_iterable``, each wrapping the one
    before it as ``ex_iterable``, or several as ``ex_iterables``: interleaved, concatenated)."""
    if not _is_hugging_face_stream(dataset):
        return None
    from datasets.iterable_dataset import BufferShuffledExamplesIterable

    pending = [getattr(dataset, "_ex_iterable", None)]
    while pending:
        step = pending.pop()
        if isinstance(step, BufferShuffledExamplesIterable):
            return int(step.buffer_size)
        if step is not None:
            pending += [getattr(step, "ex_iterable", None), *getattr(step, "ex_iterables", ())]
    return None


def keeps_position(dataset: Any) -> bool:
    """Whether ``dataset``'s own state (``state_dict``) resumes it where it stopped: stateful, and
    not a Hugging Face stream shuffled with a buffer (:func:`shuffle_buffer`)."""
    return is_stateful(dataset) and shuffle_buffer(dataset) is None


def _is_hugging_face_stream(dataset: Any) -> bool:
    if not type(dataset).__module__.startswith("datasets."):  # (imports datasets only for its own objects)
        return False
    from datasets import IterableDataset as HFIterable

    return isinstance(dataset, HFIterable)


def stateful_loader_class() -> type[DataLoader[Any]] | None:
    """``torchdata``'s StatefulDataLoader, or None when torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader  # type: ignore[no-any-return]


def is_stateful_loader(loader: Any) -> bool:
    cls = stateful_loader_class()
    return cls is not None and isinstance(loader, cls)


def shard(dataset: IterableDataset[Any], rank: int, world_size: int) -> IterableDataset[Any] | None:
    """This rank's share of ``dataset``, or None when the dataset does not say how to split it."""
    hook = getattr(dataset, SHARD_HOOK, None)
    if callable(hook):
        return hook(rank, world_size)  # type: ignore[no-any-return]
    if _is_hugging_face_stream(dataset):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return None


def rebuild_iterable(
    loader: DataLoader[Any], *, kwargs: dict[str, Any], num_replicas: int, rank: int
) -> DataLoader[Any] | None:
    """A loader over an iterable dataset as ``prepare`` runs it: this rank's share of the stream
    (when the dataset says how to split it), in a StatefulDataLoader when the dataset keeps a
    position (:func:`keeps_position`); None when there is nothing to change (not iterable, or
    neither applies). ``kwargs`` are the loader's other arguments (workers, collate_fn...)."""
    dataset = loader.dataset
    if not isinstance(dataset, IterableDataset):
        return None
    shared = shard(dataset, rank, num_replicas) if num_replicas > 1 else None
    data = dataset if shared is None else shared
    cls = stateful_loader_class() if keeps_position(data) else None
    if shared is None and (cls is None or is_stateful_loader(loader)):
        return None
    if cls is None or is_stateful_loader(loader):
        cls = type(loader)
    return cls(data, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
