"""Reading a checkpoint that may come from a stranger: regular files only, sizes and SHA-256
checked against ``meta.json`` before anything is used, pickles only through ``weights_only``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import mmap
import os
import pickle
import re
import stat
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torchrig.checkpoint.errors import CheckpointError, DamagedCheckpointError
from torchrig.checkpoint.meta import META, META_LIMIT, validate_meta

# A checkpoint folder may come from a stranger: only regular files inside it are read, opened
# without following a link and without blocking (a FIFO would wait forever), never past their size.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def _not_regular(path: Path, mode: int, error: type[CheckpointError] = CheckpointError) -> CheckpointError:
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a device or socket"
    )
    return error(
        f"{path} is {kind}, not a regular file: a checkpoint holds only regular files inside its folder; "
        "refusing to read it"
    )


def wrong_size(path: Path | str, size: int, listed: int) -> CheckpointError:
    return DamagedCheckpointError(
        f"{path} is {size} bytes but {META} says {listed}: the file was truncated or altered "
        "(checksum mismatch); refusing to load it"
    )


def open_regular(path: Path, size: int | None = None) -> io.FileIO:
    """``path`` opened for reading if it is a regular file (not a link, FIFO or device) of ``size`` bytes."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symlink
            raise _not_regular(path, stat.S_IFLNK) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if size is not None and st.st_size != size:
            raise wrong_size(path, st.st_size, size)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, size: int | None = None, *, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``: exactly ``size`` of them (default: its size when
    opened, at most ``limit``), never more, whatever happens to the file meanwhile."""
    with open_regular(path, size) as f:
        n = os.fstat(f.fileno()).st_size
        if limit is not None and n > limit:
            raise CheckpointError(f"{path} is {n} bytes, more than the {limit} a torchrig {path.name} can be")
        parts, done = [], 0
        while done < n:
            got = f.read(n - done)
            if not got:
                raise CheckpointError(f"{path} ended after {done} of its {n} bytes while it was read")
            parts.append(got)
            done += len(got)
        return b"".join(parts)  # one part (the usual case) is returned as it is, not copied


def read_meta(folder: Path) -> dict[str, Any]:
    """Parse ``meta.json`` (plain JSON: nothing in it can run code) and check it against its schema."""
    path = folder / META
    raw = read_regular(path, limit=META_LIMIT)
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as err:
        why = "it nests too deeply" if isinstance(err, RecursionError) else str(err)
        raise CheckpointError(f"{path} is not valid JSON ({why}); the checkpoint is damaged") from None
    return validate_meta(meta, path)


def read_meta_quiet(folder: Path) -> dict[str, Any] | None:
    """:func:`read_meta`, or ``None`` where there is no valid one (a FIFO or a link is not read)."""
    try:
        return read_meta(folder)
    except (OSError, CheckpointError):
        return None


# Folders torchrig filled itself (a download into a private temp folder, :func:`~torchrig.checkpoint.remote.fetched`)
# -> the SHA-256 of each file there, computed from its bytes as they arrived (see :func:`hashed_on_arrival`).
_ARRIVED: dict[str, dict[str, str]] = {}


@contextlib.contextmanager
def hashed_on_arrival(folder: Path, digests: dict[str, str]) -> Iterator[None]:
    """While inside, every :class:`VerifiedReader` of ``folder`` takes ``digests`` (file name ->
    SHA-256) as the hashes of those files instead of reading and hashing them again; files
    added to ``digests`` meanwhile (downloaded later) count too.

    Only for a private folder torchrig made and wrote itself, the digests taken from the very
    bytes it wrote there (a download hashed as it arrived): the reader still compares each one
    with ``meta.json`` before anything is parsed or filled, exactly as it compares its own.
    """
    key = os.fspath(folder)
    _ARRIVED[key] = digests
    try:
        yield
    finally:
        del _ARRIVED[key]


class VerifiedReader:
    """Opens the files of a checkpoint, checking each size at once and its SHA-256 in a thread.

    Hashing runs beside deserialization (hashlib and file reads release the GIL), and
    :meth:`check` is called before anything is loaded into the user's objects, so a damaged
    checkpoint changes nothing. Files of a download hashed as they arrived
    (:func:`hashed_on_arrival`) are not hashed again: their digests are compared instead.
    """

    def __init__(self, folder: Path, meta: dict[str, Any], *, verify: bool = True) -> None:
        self.folder = folder
        self.meta = meta
        self.verify = verify
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="torchrig-verify")
        self._hashes: dict[str, Future[str]] = {}
        self._arrived = _ARRIVED.get(os.fspath(folder), {})

    def _sha256(self, name: str, path: Path) -> str:
        """The SHA-256 of the file ``name`` (at ``path``): the one taken as it arrived, or hashed now."""
        known = self._arrived.get(name)
        return known if known is not None else sha256_file(path, self.meta["files"][name]["size"])

    def path(self, name: str, *, hashing: bool = True) -> Path:
        """The path of ``name`` after checking it is listed and has the listed size.

        With ``hashing`` (and ``verify``), its SHA-256 starts on the pool, for :meth:`check`.
        """
        entry = self.meta["files"].get(name)  # read_meta checked every listed name is a plain file name
        path = self.folder / name
        if entry is None:
            raise DamagedCheckpointError(f"{path} is not listed in {self.folder / META}; the checkpoint is damaged")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise DamagedCheckpointError(f"{path} is missing; {META} lists it ({entry['size']} bytes)") from None
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, DamagedCheckpointError)
        if st.st_size != entry["size"]:
            raise wrong_size(path, st.st_size, entry["size"])
        if hashing and self.verify and name not in self._hashes:
            self._hashes[name] = self._pool.submit(self._sha256, name, path)
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
            raise DamagedCheckpointError(
                f"checksum mismatch in {self.folder / name}: SHA-256 is {digest}, {META} says {want}; "
                "the file was altered or corrupted, refusing to load it"
            )

    def checked_bytes(self, name: str) -> bytes:
        """The bytes of ``name``, read once, compared with the SHA-256 ``meta.json`` lists (with
        ``verify``) before anyone parses them: for a file whose parsing itself must not see
        altered bytes (DCP's ``.metadata`` pickle)."""
        path = self.path(name, hashing=False)
        data = read_regular(path)
        if self.verify:
            known = self._arrived.get(name)
            self.compare(name, known if known is not None else hashlib.sha256(data).hexdigest())
        return data

    def submit(self, name: str, fn: Callable[[Path, bool], tuple[Any, str | None]]) -> Future[Any]:
        """Run ``fn(path, hashing) -> (result, SHA-256 of the bytes it read)`` on the pool.

        The future gives ``result`` only once the digest matches ``meta.json``: ``fn`` reads the
        file once, and the bytes it hashed are the bytes it deserialized. A file hashed as it
        arrived is compared first, and ``fn`` asked for no hash.
        """
        path = self.path(name, hashing=False)
        return self._pool.submit(self._run, name, path, fn)

    def _run(self, name: str, path: Path, fn: Callable[[Path, bool], tuple[Any, str | None]]) -> Any:
        arrived = self.verify and name in self._arrived
        if arrived:
            self.compare(name, self._arrived[name])  # before anything parses the bytes
        try:
            result, digest = fn(path, self.verify and not arrived)
        except CheckpointError:
            if self.verify:
                self.compare(name, self._sha256(name, path))
            raise
        except Exception as err:
            if self.verify:  # a damaged file is the likely cause: say so first
                self.compare(name, self._sha256(name, path))
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

    def close(self, *, wait: bool = True) -> None:
        """Stop the pool; ``wait=False`` returns at once, and reads still running finish on their own."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> VerifiedReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Ctrl-C leaves at once. On an error the reads under way (bounded: every file is regular and
        # read up to its size) are waited for, so none still maps a file when the caller moves on.
        self.close(wait=exc_type is None or issubclass(exc_type, Exception))


def sha256_file(path: Path, size: int | None = None) -> str:
    """SHA-256 of a regular file (of ``size`` bytes), hashed straight from the page cache through mmap."""
    with open_regular(path, size) as f:
        n = os.fstat(f.fileno()).st_size
        if n == 0:
            return hashlib.sha256().hexdigest()
        with mmap.mmap(f.fileno(), n, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()


def verify_files(folder: Path, meta: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """``(name, size, ok)`` for every file ``meta.json`` lists (for ``inspect``)."""
    out = []
    with VerifiedReader(folder, meta) as reader:
        for name in sorted(meta["files"]):
            try:
                reader.path(name)
                reader.check(name)
                out.append((name, meta["files"][name]["size"], True))
            except (CheckpointError, OSError):
                out.append((name, meta["files"][name]["size"], False))
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _unpickling_refusal(path: Path, data: bytes, err: Exception) -> CheckpointError:
    """The weights_only refusal said plainly: the file, the objects it names, no torch advice or colour codes."""
    try:
        names = unsafe_globals(io.BytesIO(data))
    except Exception:  # not a readable torch.save archive: torch's own reason is all there is
        names = []
    if names:
        what = f"Python objects other than tensors and plain containers ({', '.join(names)})"
    else:
        text = " ".join(_ANSI.sub("", str(err)).split())
        reason = text.split("WeightsUnpickler error: ", 1)[-1].split(" Please use ", 1)[0]
        what = f"data that weights_only loading refuses ({reason.rstrip('.')})"
    return CheckpointError(
        f"refusing to load {path}: it holds {what}, which could run code when unpickled; torchrig only "
        "loads tensors, numbers, strings, lists, tuples and dicts, and nothing in the file was run"
    )


def safe_torch_load(path: Path, *, map_location: Any = None, data: bytes | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` (or of its bytes ``data``): tensors and plain
    containers only, never code.

    A file that holds any other Python object (a pickle payload) is refused before anything in
    it runs, with a :class:`CheckpointError` naming the objects.
    """
    if data is None:
        data = read_regular(path)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _unpickling_refusal(path, data, err) from None


def read_torch_once(path: Path, hashing: bool, *, map_location: Any = None) -> tuple[Any, str | None]:
    """:func:`safe_torch_load` of a file read once, and the SHA-256 of those bytes.

    The hash runs on a second thread (hashlib releases the GIL) beside the unpickling.
    """
    data = read_regular(path)
    if not hashing:
        return safe_torch_load(path, map_location=map_location, data=data), None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-hash") as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        obj = safe_torch_load(path, map_location=map_location, data=data)
        return obj, digest.result()


def unsafe_globals(f: io.BytesIO) -> list[str]:
    """Python classes/functions a ``torch.save`` payload refers to that weights_only loading refuses."""
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))


def not_a_checkpoint(p: Path) -> str:
    """Why the file ``p`` is no checkpoint: what it is, read from its first bytes (nothing is
    unpickled), and how to read it instead."""
    kind, fix = "a file", ""
    try:
        with open(p, "rb") as f:
            size = int.from_bytes(f.read(8), "little")  # safetensors: the header's length, then its JSON
            if 2 <= size <= min(p.stat().st_size - 8, 100 * 2**20):
                json.loads(f.read(size))
                kind, fix = "a safetensors file", f"read it with safetensors.torch.load_file({str(p)!r})"
    except (OSError, ValueError):
        pass
    if not fix and zipfile.is_zipfile(p):
        with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(p) as archive:  # what torch.save writes
            pickled = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if pickled and b"pytorch-lightning_version" in archive.read(pickled[0]):
                kind, fix = "a Lightning checkpoint", f"convert it once with `torchrig checkpoint import {p} OUT`"
            elif pickled:
                kind, fix = "a file torch.save wrote", f"read it with torch.load({str(p)!r}, weights_only=True)"
    text = f"{p} is {kind}, but a torchrig checkpoint is a directory holding {META}"
    return f"{text}; {fix}" if fix else text
