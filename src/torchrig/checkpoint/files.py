"""Files of a checkpoint: durable writes, checksums, atomic commit, retention, safe reading.

Nothing here knows about models or optimizers: it moves bytes and guarantees that a directory
at the final path is either complete (every file fsynced and listed with its SHA-256 in
``meta.json``) or not there at all.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

META = "meta.json"
FORMAT = "torchrig.checkpoint"
FORMAT_VERSION = 2  # 2: tensors may be split over several safetensors files
_CHUNK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, altered, unsafe, or does not match what it is loaded into."""


# -- writing ------------------------------------------------------------------------------
def _write_fsync(path: Path, data: bytes | memoryview) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def durable(path: Path) -> None:
    """fsync a file that was just written (its data reaches the disk before the rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows: directories cannot be opened, and NTFS renames are journaled
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through, the hash beside the write.

    ``torch.save`` hands over each tensor's bytes in one call, valid only during it: large
    buffers are hashed on a second thread (hashlib releases the GIL) while this one writes them.
    """

    def __init__(self, f: io.BufferedWriter) -> None:
        super().__init__()
        self._f = f
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-hash")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if view.nbytes < _CHUNK:
            self._hash.update(view)
            self._f.write(view)
        else:
            hashed = self._pool.submit(self._hash.update, view)
            self._f.write(view)
            hashed.result()
        return view.nbytes

    def hexdigest(self) -> str:
        self._pool.shutdown(wait=True)
        return self._hash.hexdigest()


def write_torch(path: Path, obj: Any) -> str:
    """``torch.save`` into ``path``, fsynced; returns the SHA-256 of the bytes written."""
    with open(path, "xb") as f:
        writer = HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]
        digest = writer.hexdigest()
        f.flush()
    durable(path)
    return digest


class FileSet:
    """Writes the files of one checkpoint into ``folder`` in parallel; each job returns its SHA-256.

    Example:
        >>> # with FileSet(tmp) as fs: fs.add("state.pt", lambda p: write_torch(p, obj)); fs.finish()
    """

    def __init__(self, folder: Path, *, workers: int = 4) -> None:
        self.folder = folder
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="torchrig-ckpt")
        self._jobs: dict[str, Future[str]] = {}

    def add(self, name: str, write: Callable[[Path], str]) -> None:
        """Run ``write(path) -> sha256`` on a worker thread."""
        self._jobs[name] = self._pool.submit(write, self.folder / name)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait for every write (re-raising the first error, ENOSPC included); the files table."""
        return {
            name: {"sha256": job.result(), "size": (self.folder / name).stat().st_size}
            for name, job in self._jobs.items()
        }

    def __enter__(self) -> FileSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def hash_existing(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of files already written into ``folder`` (by DCP on every rank)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        digests = list(pool.map(lambda n: sha256_file(folder / n), names))
    return {n: {"size": (folder / n).stat().st_size, "sha256": d} for n, d in zip(names, digests, strict=True)}


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """``meta.json`` goes last: its presence is what makes a directory a checkpoint."""
    _write_fsync(folder / META, json.dumps(meta, indent=1, sort_keys=True).encode())
    fsync_dir(folder)


# -- committing ---------------------------------------------------------------------------
def temp_dir_for(target: Path) -> Path:
    """A fresh hidden directory next to ``target`` (same file system, so the rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``, replacing an older checkpoint there.

    A directory cannot be swapped atomically on POSIX, so an existing target is first renamed
    to ``.NAME.old-*``; if the process dies between the two renames, :func:`resolve_checkpoint`
    finds the previous checkpoint there.
    """
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def update_link(target: Path, name: str) -> None:
    """Point ``target.parent / name`` at ``target`` by replacing a temporary symlink over it."""
    link = target.parent / name
    if link.exists() and not link.is_symlink():
        raise CheckpointError(
            f"cannot update the {name!r} link: {link} exists and is not a symlink; remove it or pass link=None"
        )
    tmp = target.parent / f".{name}.link-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.symlink(target.name, tmp, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(target.parent)


def _read_meta_quiet(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def apply_retention(target: Path, keep_last: int) -> list[Path]:
    """Delete the oldest checkpoints next to ``target`` so that ``keep_last`` remain; returns them.

    Only visible sibling directories holding a torchrig ``meta.json`` count; ``target`` is kept.
    """
    found: list[tuple[int, Path]] = []
    for p in target.parent.iterdir():
        if p.name.startswith(".") or p.is_symlink() or not p.is_dir() or p == target:
            continue
        meta = _read_meta_quiet(p)
        if meta is not None:
            found.append((int(meta.get("saved_at_ns", 0)), p))
    found.sort()
    doomed = [p for _, p in found[: max(0, len(found) - (keep_last - 1))]]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def remove_stale_temps(parent: Path) -> None:
    """Remove temporary directories left by saves whose process is gone (killed mid-save)."""
    for p in parent.glob(".*.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- reading ------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory at ``path`` (following a ``last`` link); errors say what is there."""
    p = Path(path)
    if p.is_dir():
        if not (p / META).is_file():
            raise CheckpointError(
                f"{p} is not a torchrig checkpoint: it has no {META} (a save that was interrupted never "
                "leaves a directory at the final path, so this directory was made by something else)"
            )
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file, but a torchrig checkpoint is a directory holding {META}")
    olds = sorted(p.parent.glob(f".{p.name}.old-*"), key=lambda q: q.stat().st_mtime) if p.parent.is_dir() else []
    olds = [q for q in olds if _read_meta_quiet(q) is not None]
    if olds:
        warnings.warn(
            f"{p} is missing because a save was interrupted while replacing it; loading the previous "
            f"checkpoint from {olds[-1]}",
            stacklevel=3,
        )
        return olds[-1]
    raise FileNotFoundError(f"no checkpoint at {p}")


def read_meta(folder: Path) -> dict[str, Any]:
    """Parse ``meta.json`` (plain JSON: nothing in it can run code)."""
    try:
        meta = json.loads((folder / META).read_text())
    except ValueError as err:
        raise CheckpointError(f"{folder / META} is not valid JSON ({err}); the checkpoint is damaged") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder / META} is not a torchrig checkpoint description (format != {FORMAT!r})")
    if int(meta.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} was written by a newer torchrig (checkpoint format {meta['version']}, this one reads "
            f"up to {FORMAT_VERSION}); upgrade torchrig to load it"
        )
    return meta


class VerifiedReader:
    """Opens the files of a checkpoint, checking each size at once and its SHA-256 in a thread.

    Hashing runs beside deserialization (hashlib and file reads release the GIL), and
    :meth:`check` is called before anything is loaded into the user's objects, so a damaged
    checkpoint changes nothing.
    """

    def __init__(self, folder: Path, meta: dict[str, Any], *, verify: bool = True) -> None:
        self.folder = folder
        self.meta = meta
        self.verify = verify
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="torchrig-verify")
        self._hashes: dict[str, Future[str]] = {}

    def path(self, name: str, *, hashing: bool = True) -> Path:
        """The path of ``name`` after checking it is listed and has the listed size.

        With ``hashing`` (and ``verify``), its SHA-256 starts on the pool, for :meth:`check`.
        """
        entry = self.meta.get("files", {}).get(name)
        path = self.folder / name
        if entry is None:
            raise CheckpointError(f"{path} is not listed in {self.folder / META}; the checkpoint is damaged")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; {META} lists it ({entry['size']} bytes)") from None
        if size != entry["size"]:
            raise CheckpointError(
                f"{path} is {size} bytes but {META} says {entry['size']}: the file was truncated or altered "
                "(checksum mismatch); refusing to load it"
            )
        if hashing and self.verify and name not in self._hashes:
            self._hashes[name] = self._pool.submit(sha256_file, path)
        return path

    def check(self, name: str | None = None) -> None:
        """Raise :class:`CheckpointError` naming the file whose SHA-256 differs from ``meta.json``."""
        for n in [name] if name is not None else list(self._hashes):
            if n in self._hashes:
                self.compare(n, self._hashes[n].result())

    def compare(self, name: str, digest: str) -> None:
        """Raise :class:`CheckpointError` if ``digest`` is not the SHA-256 ``meta.json`` lists for ``name``."""
        want = self.meta["files"][name]["sha256"]
        if digest != want:
            raise CheckpointError(
                f"checksum mismatch in {self.folder / name}: SHA-256 is {digest}, {META} says {want}; "
                "the file was altered or corrupted, refusing to load it"
            )

    def submit(self, name: str, fn: Callable[[Path, bool], tuple[Any, str | None]]) -> Future[Any]:
        """Run ``fn(path, hashing) -> (result, SHA-256 of the bytes it read)`` on the pool.

        The future gives ``result`` only once the digest matches ``meta.json``: ``fn`` reads the
        file once, and the bytes it hashed are the bytes it deserialized.
        """
        path = self.path(name, hashing=False)
        return self._pool.submit(self._run, name, path, fn)

    def _run(self, name: str, path: Path, fn: Callable[[Path, bool], tuple[Any, str | None]]) -> Any:
        try:
            result, digest = fn(path, self.verify)
        except CheckpointError:
            if self.verify:
                self.compare(name, sha256_file(path))
            raise
        except Exception as err:
            if self.verify:  # a damaged file is the likely cause: say so first
                self.compare(name, sha256_file(path))
            raise CheckpointError(f"could not read {path}: {type(err).__name__}: {err}") from err
        if digest is not None:
            self.compare(name, digest)
        return result

    def read(self, name: str, fn: Callable[[Path], Any]) -> Any:
        """``fn(path)``; if it fails, a checksum mismatch is reported first (it is the likely cause)."""
        path = self.path(name)
        try:
            return fn(path)
        except CheckpointError:
            self.check(name)
            raise
        except Exception as err:
            self.check(name)
            raise CheckpointError(f"could not read {path}: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> VerifiedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, hashed straight from the page cache through mmap (no read copy)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()


def verify_files(folder: Path, meta: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """``(name, size, ok)`` for every file ``meta.json`` lists (for ``inspect``)."""
    out = []
    with VerifiedReader(folder, meta) as reader:
        for name in sorted(meta.get("files", {})):
            try:
                reader.path(name)
                reader.check(name)
                out.append((name, int(meta["files"][name]["size"]), True))
            except CheckpointError:
                out.append((name, int(meta["files"][name]["size"]), False))
    return out


def safe_torch_load(path: Path, *, map_location: Any = None, data: bytes | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` (or of its bytes ``data``): tensors and plain
    containers only, never code.

    A file that holds any other Python object (a pickle payload) is refused before anything in
    it runs.
    """
    try:
        source = path if data is None else io.BytesIO(data)
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to load {path}: it holds Python objects other than tensors and plain containers, "
            f"which could run code when unpickled. torchrig only loads weights_only data. Details: "
            f"{str(err).splitlines()[0]}"
        ) from None


def read_torch_once(path: Path, hashing: bool, *, map_location: Any = None) -> tuple[Any, str | None]:
    """:func:`safe_torch_load` of a file read once, and the SHA-256 of those bytes.

    The hash runs on a second thread (hashlib releases the GIL) beside the unpickling.
    """
    data = path.read_bytes()
    if not hashing:
        return safe_torch_load(path, map_location=map_location, data=data), None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-hash") as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        obj = safe_torch_load(path, map_location=map_location, data=data)
        return obj, digest.result()


def unsafe_globals(f: io.BytesIO) -> list[str]:
    """Python classes/functions a ``torch.save`` payload refers to that weights_only loading refuses."""
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
