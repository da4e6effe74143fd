"""Reading DCP's files without running what they name: its ``.metadata`` pickle through a restricted
unpickler (DCP itself would ``pickle.load`` it), the parsed metadata handed to DCP's reader, and
non-tensor items through a ``weights_only`` load planner (DCP's default planner unpickles them freely).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import pathlib
import pickle
import pickletools
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.meta import DCP_METADATA


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` pickle names, as ``(module, name)`` -> the object itself.

    Exact pairs only (never a module prefix, never a dotted name): DCP's metadata dataclasses and
    enum, the record of where each item lies in a shard file, ``torch.Size``, torch's dtypes and
    layouts, and the ``pathlib`` class of the folder DCP saved to.
    """
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], Any] = {}
    dcp_classes = {
        "torch.distributed.checkpoint.metadata": (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        ),
        "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    }
    modules = {"torch.distributed.checkpoint.metadata": metadata, "torch.distributed.checkpoint.filesystem": filesystem}
    for module, names in dcp_classes.items():
        table.update({(module, n): getattr(modules[module], n) for n in names if hasattr(modules[module], n)})
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):  # dtypes, layouts and memory formats are pickled by name: data, not callables
        if isinstance(getattr(torch, name), (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", name)] = getattr(torch, name)
    native = type(pathlib.Path()).__name__
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        cls = getattr(pathlib, name if name.startswith("Pure") or name == native else f"Pure{name}")
        for module in ("pathlib", "pathlib._local"):  # where Python 3.13 defines them
            table[(module, name)] = cls  # a path saved on another OS is kept as its pure path
    return table


# Opcodes that only build data (or that the unpickler below restricts); the others (INST, OBJ,
# NEWOBJ_EX, EXT*, PERSID, out-of-band buffers) are never in a DCP metadata file and are refused.
_DATA_OPCODES = frozenset(
    """PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4
    FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES
    SHORT_BINBYTES BINBYTES8 BYTEARRAY8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST LIST APPEND APPENDS
    EMPTY_DICT DICT SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT
    MEMOIZE GLOBAL STACK_GLOBAL REDUCE NEWOBJ BUILD""".split()  # noqa: SIM905
)


class _RefusedOpcodes(dict):  # type: ignore[type-arg]
    def __missing__(self, code: int) -> Any:
        name = next((op.name for op in pickletools.opcodes if op.code == chr(code)), f"{code:#04x}")
        raise _RefusedError(f"it uses the pickle opcode {name}, which a DCP metadata file never holds")


class _RefusedError(Exception):
    pass


class _MetadataUnpickler(pickle._Unpickler):
    """A pickle reader that can only build DCP's metadata: exact allow-listed globals, data opcodes,
    and calls (``REDUCE``, ``NEWOBJ``) and attribute restores (``BUILD``) of the allow-listed classes only.

    Python's pure-Python unpickler, with its opcode table cut down: the C one cannot be kept from
    ``BUILD`` setting attributes on an allowed class itself (patching it for the whole process).
    """

    stack: list[Any]  # the unpickler's stack (pickle._Unpickler's own attribute)
    dispatch = _RefusedOpcodes(
        {
            op.code.encode("latin-1")[0]: pickle._Unpickler.dispatch[op.code.encode("latin-1")[0]]
            for op in pickletools.opcodes
            if op.name in _DATA_OPCODES
        }
    )

    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file)
        table = _metadata_globals()
        self._callables = {id(v): v for v in table.values() if callable(v)}
        self._classes = {v for v in table.values() if isinstance(v, type)}
        self._made: dict[int, Any] = {}  # objects NEWOBJ made in this load: the only ones BUILD may fill

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
        if found is None:
            raise _RefusedError(f"it names the Python object {name!r} of module {module!r}")
        return found

    def _call(self, func: Any) -> None:
        if id(func) not in self._callables:
            raise _RefusedError(f"it calls a {type(func).__name__}, {func!r:.80}")

    def load_reduce(self) -> None:
        self._call(self.stack[-2])
        super().load_reduce()  # type: ignore[misc]

    def load_newobj(self) -> None:
        self._call(self.stack[-2])
        super().load_newobj()  # type: ignore[misc]
        made = self.stack[-1]
        self._made[id(made)] = made  # kept alive, so its id is not reused during the load

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type):  # would patch the class for the whole process
            raise _RefusedError(f"it sets attributes of the class {inst.__module__}.{inst.__qualname__}")
        if type(inst) not in self._classes:
            raise _RefusedError(f"it sets attributes of a {type(inst).__name__}")
        if id(inst) not in self._made:  # an enum member (a REDUCE returns the process's own), torch.Size...
            raise _RefusedError(
                f"it sets attributes of the {type(inst).__name__} {inst!r:.60}, an object it did not create but "
                "one shared by this whole process"
            )
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise _RefusedError(f"it sets the attributes {list(part)} of a {type(inst).__name__}")
        super().load_build()  # type: ignore[misc]

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def parse_dcp_metadata(path: Path, data: bytes, files: Collection[str]) -> Any:
    """DCP's ``Metadata`` from the bytes of ``path``, without running anything they name.

    DCP itself reads this file with plain ``pickle.load``; torchrig reads it here instead (and hands
    the result to DCP through :func:`checked_reader`), so a pickle payload is refused before it runs: a
    :class:`CheckpointError` naming the file and the global. Every shard file it points DCP at must
    be one of ``files`` (listed in ``meta.json``, so checked like the rest).
    """
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except _RefusedError as err:
        raise CheckpointError(
            f"refusing to load {path}: {err}, which could run code when unpickled; a DCP metadata file only "
            "holds DCP's own classes, torch.Size and dtypes, and nothing in it was run"
        ) from None
    except Exception as err:
        raise CheckpointError(f"{path} is not a readable DCP metadata file: {type(err).__name__}: {err}") from None
    if (
        type(md) is not Metadata
        or not isinstance(md.state_dict_metadata, dict)
        or not isinstance(md.storage_data, dict)
        or not isinstance(md.planner_data, (dict, type(None)))
    ):
        raise CheckpointError(f"{path} is not a DCP metadata file: it holds a {type(md).__name__}")
    for info in md.storage_data.values():
        ok = (
            type(info) is filesystem._StorageInfo and info.relative_path in files and info.relative_path != DCP_METADATA
        )
        if not ok or not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise CheckpointError(
                f"{path} points at {getattr(info, 'relative_path', info)!r}, which is not a shard file listed in "
                "meta.json; refusing to read it"
            )
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and transforms != [] and transforms != ():  # torchrig saves with none
            raise CheckpointError(
                f"{path} asks DCP to decode a shard with the stream transforms {transforms!r:.100}, which torchrig "
                "never writes; refusing to read it"
            )
    count = len(md.state_dict_metadata)  # where a list index in an item's path is bounded (DCP grows lists to it)
    for key, where in (md.planner_data or {}).items():
        if not isinstance(where, tuple) or not all(
            isinstance(k, str) or (type(k) is int and 0 <= k <= count) for k in where
        ):
            raise CheckpointError(f"{path} gives the item {key!r} the path {where!r:.100}, not a state-dict path")
    return md


def checked_reader(
    folder: Path, md: Any, before_read: Callable[[set[str]], None], *, checkpoint: str | None = None
) -> Any:
    """DCP's file reader for ``folder``, whose metadata is ``md`` (already read safely), never the file.

    ``before_read(names)`` gets the shard files this rank's read plan names (and no other) as the
    rank plans, before any rank reads: it makes them present and checks them. What it raises on
    any rank fails the load on every rank (DCP gathers the plans) before a tensor is written.
    ``checkpoint`` names what this rank found at ``folder`` (a digest of its ``meta.json``): each
    rank's plan carries it, and ranks that found different checkpoints there (another process
    saved while they looked) are refused together, as they plan, instead of reading a mix.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # what FileSystemReader does after unpickling
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def prepare_local_plan(self, plan: Any) -> Any:  # DCP gathers its failure from every rank
            before_read({self.storage_data[item.storage_index].relative_path for item in plan.items})
            return dataclasses.replace(plan, storage_data=checkpoint)

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:  # rank zero, every rank's plan
            found = [p.storage_data for p in plans]
            if len(set(found)) > 1:
                ranks = {f: [r for r, g in enumerate(found) if g == f] for f in dict.fromkeys(found)}
                shown = "; ".join(f"ranks {r} one (meta.json {str(f)[:12]})" for f, r in ranks.items())
                raise CheckpointError(
                    f"the ranks found different checkpoints at {folder} ({shown}): another process saved there "
                    "while they loaded it; nothing was loaded on any rank: load it again"
                )
            return list(super().prepare_global_plan(plans))

    return CheckedReader(str(folder))


def safe_planner(*, keys: list[str] | None = None) -> Any:
    """DCP's load planner, but non-tensor items are read with ``weights_only=True``.

    DCP's default ``load_bytes`` unpickles with weights-only checking turned off; with ``keys`` the planner
    builds the state dict from the checkpoint itself (for consolidation, no model needed).
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore[attr-defined]
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            if keys is None:  # the targets are given: plain DefaultLoadPlanner behaviour
                DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)
            else:
                super().set_up_planner(state_dict, metadata, is_coordinator)

    return SafeLoadPlanner(keys=keys)


@contextlib.contextmanager
def refuse_code(folder: Path) -> Iterator[None]:
    """DCP reports our planner's weights_only refusal wrapped per rank; say it plainly. Whatever else
    DCP raises while reading (its ``CheckpointException`` is a ``BaseException``, which ``except
    Exception`` lets through) is a :class:`CheckpointError` naming the rank and the error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as err:
        if "Weights only load failed" in str(err):
            raise CheckpointError(
                f"refusing to load {folder}: a shard holds Python objects other than tensors and plain "
                "containers, which could run code when unpickled; torchrig only loads weights_only data"
            ) from None
        if not isinstance(err, CheckpointException):
            raise
        rank, failure = next(iter(err.failures.items()), (0, (err, None)))
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, CheckpointError):  # a rank's shard refused before any rank read: said as it is
            raise type(cause)(str(cause)) from None  # a damaged file stays a DamagedCheckpointError
        first = (str(cause).splitlines() or [""])[0]
        raise CheckpointError(
            f"could not read the shards of {folder}: DCP failed on rank {rank}: {type(cause).__name__}: {first}; "
            "the checkpoint is damaged or was altered"
        ) from None
