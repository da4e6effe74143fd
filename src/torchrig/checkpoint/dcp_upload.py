"""DCP's shards uploaded to object storage: DCP's own fsspec writer (``FsspecWriter``), hashing
every file while it is uploaded (:class:`~torchrig.checkpoint.files.HashingWriter`), so the
``meta.json`` of a sharded checkpoint on object storage lists each file's size and SHA-256 as a
local one does, without reading any of them back.

Each rank hashes the files it writes; the digests travel to the coordinator (rank zero) with
DCP's own write results, as entries that :meth:`UploadingWriter.finish` takes out again before
DCP's ``.metadata`` is written (no collective of torchrig's own, and nothing of them in DCP's
files). Imported only by a sharded save to a URL (``torch.distributed.checkpoint`` is slow to import).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any, cast

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchrig.checkpoint.files import HashingWriter

_DIGEST = "\0torchrig-file\0"  # the fqn prefix of a digest entry: no state-dict key starts with a NUL


class _HashingFileSystem(FileSystem):
    """fsspec as DCP sees it, every file written hashed on its way: ``files`` maps each file name
    (relative to the checkpoint) to its ``{"sha256", "size"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            writer = HashingWriter(stream)
            try:
                yield writer  # DCP may close it: that closes the hashing view, the upload stream closes here
            finally:
                digest = writer.hexdigest()  # and its hashing thread ends, whatever happened
        entry = {"sha256": digest, "size": writer.size}
        with self._lock:
            self.files[os.path.basename(os.fspath(path))] = entry

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP's ``.metadata.tmp`` -> ``.metadata``
        with self._lock:
            entry = self.files.pop(os.path.basename(os.fspath(path)), None)
            if entry is not None:
                self.files[os.path.basename(os.fspath(new_path))] = entry


class UploadingWriter(FsspecWriter):
    """DCP's fsspec writer into ``url``; after the save, on the coordinator, :attr:`files` holds
    the size and SHA-256 of every file the save wrote on every rank, ``.metadata`` included.

    No ``fsync`` (``sync_files=False``): an object is durable once its upload returns, and DCP,
    finding no file descriptor, would ``os.sync()`` the whole machine instead.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url, sync_files=False, overwrite=False)
        self.hashing = _HashingFileSystem()
        self.fs = cast(Any, self.hashing)  # DCP types it as its local FileSystem; FsspecWriter's is fsspec's too
        self.path = self.fs.init_path(url)
        self.files: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).wait()  # FsspecWriter writes before it returns
        digests = [WriteResult(MetadataIndex(_DIGEST + name), 0, entry) for name, entry in self.hashing.files.items()]
        out: Future[list[WriteResult]] = Future()
        out.set_result([*written, *digests])
        return out

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        plain: list[list[WriteResult]] = [[] for _ in results]
        for rank, written in enumerate(results):
            for r in written:
                if r.index.fqn.startswith(_DIGEST):
                    self.files[r.index.fqn[len(_DIGEST) :]] = r.storage_data
                else:
                    plain[rank].append(r)
        super().finish(metadata, plain)
        self.files.update(self.hashing.files)  # ``.metadata``, written just now
