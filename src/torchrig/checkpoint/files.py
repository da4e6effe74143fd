"""Files of a checkpoint: durable writes, checksums, atomic commit, retention, safe reading.

Nothing here knows about models or optimizers: it moves bytes and guarantees that a directory
at the final path is either complete (every file fsynced and listed with its SHA-256 in
``meta.json``) or not there at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import json
import mmap
import os
import pickle
import re
import shutil
import socket
import stat
import sys
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


def _umask() -> int:
    for line in _read_text("/proc/self/status").splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc: read it the only other way, setting it back at once
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a file written by a library that creates it 0600 (safetensors) the mode ``open`` gives."""
    os.chmod(path, 0o666 & ~_umask())


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
# Names this process leaves next to a checkpoint while it saves: ``.NAME.tmp-OWNER-RANDOM`` (the
# files being written), ``.NAME.old-OWNER-RANDOM`` (the previous checkpoint while it is replaced
# without an atomic exchange), ``.LINK.link-OWNER-RANDOM`` (a new symlink before it replaces
# ``last``). OWNER is ``HOST.BOOT.PIDNS-PID``: hashes of the host name, the kernel's boot id and the
# pid namespace, then the pid. A pid means something only on its own host, boot and namespace, so
# leftovers are reaped only when that is ours (and the pid is dead), or when they come from an
# earlier boot of this host (see :func:`remove_stale_temps`).
_LEFTOVER = re.compile(
    r"\.(?P<name>.+)\.(?P<kind>tmp|old|link)-(?P<host>[0-9a-f]{8})\.(?P<boot>[0-9a-f]{8})\.(?P<ns>[0-9a-f]{8})"
    r"-(?P<pid>[0-9]+)-[0-9a-f]{8}"
)


def _tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _origin() -> tuple[str, str, str]:
    """Hashes of this host's name, this boot of its kernel, and this process's pid namespace."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return _tag(socket.gethostname()), _tag(_read_text("/proc/sys/kernel/random/boot_id")), _tag(ns)


def _boot_time() -> float | None:
    """When this machine booted (seconds since the epoch), where the kernel says."""
    for line in _read_text("/proc/stat").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return None


def leftover_name(target: Path, kind: str) -> Path:
    """A fresh ``.NAME.KIND-OWNER-RANDOM`` path next to ``target`` (see :data:`_LEFTOVER`)."""
    host, boot, ns = _origin()
    return target.parent / f".{target.name}.{kind}-{host}.{boot}.{ns}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_dir_for(target: Path) -> Path:
    """A fresh hidden directory next to ``target`` (same file system, so the rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = leftover_name(target, "tmp")
    tmp.mkdir()
    return tmp


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: list[Any] = []  # libc's renameat2, looked up once ([None] where there is none)


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    False where the OS, its C library or the file system cannot (nothing was changed then).
    """
    if not _renameat2:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
            except OSError:
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
        _renameat2.append(fn)
    fn = _renameat2[0]
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove_checkpoint(folder: Path, *, ignore_errors: bool = True) -> None:
    """Delete a checkpoint directory, ``meta.json`` first: a half-deleted one is never taken for whole.

    What another process removed meanwhile is never an error; with ``ignore_errors=False`` others are.
    """

    def gone(_fn: Any, _path: Any, exc: Any) -> None:
        if not (ignore_errors or isinstance(exc[1], FileNotFoundError)):
            raise exc[1]

    with contextlib.suppress(OSError):
        os.unlink(folder / META)
    shutil.rmtree(folder, onerror=gone)


def commit(tmp: Path, target: Path) -> None:
    """Put the finished ``tmp`` at ``target``, replacing an older checkpoint there.

    Where the OS can (Linux, on most file systems) the two directories are swapped in one step,
    so ``target`` always holds a whole checkpoint, old or new. Elsewhere the old one is first
    renamed to ``.NAME.old-*``: a kill between the two renames leaves ``target`` missing for a
    moment, and :func:`resolve_checkpoint` (also through a ``last`` link) then loads the previous
    checkpoint from there; the next save puts it back or removes it (:func:`remove_stale_temps`).
    """
    if not target.exists():
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return
    if exchange(tmp, target):
        fsync_dir(target.parent)
        _remove_checkpoint(tmp)  # now the previous checkpoint
        return
    old = leftover_name(target, "old")
    os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    _remove_checkpoint(old)


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def update_link(target: Path, name: str) -> None:
    """Point ``target.parent / name`` at ``target`` by replacing a temporary symlink over it."""
    link = target.parent / name
    if link.exists() and not link.is_symlink():
        raise CheckpointError(
            f"cannot update the {name!r} link: {link} exists and is not a symlink; remove it or pass link=None"
        )
    tmp = leftover_name(link, "link")
    os.symlink(target.name, tmp, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(target.parent)


def _read_meta_quiet(folder: Path) -> dict[str, Any] | None:
    """:func:`read_meta`, or ``None`` where there is no valid one (a FIFO or a link is not read)."""
    try:
        return read_meta(folder)
    except (OSError, CheckpointError):
        return None


def apply_retention(target: Path, keep_last: int) -> list[Path]:
    """Delete the oldest checkpoints next to ``target`` so that ``keep_last`` remain; returns them.

    Only visible sibling directories holding a torchrig ``meta.json`` count; ``target`` is kept.
    Another process may save and prune in the same folder: a checkpoint it removed meanwhile is
    simply no longer counted.
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
        _remove_checkpoint(p, ignore_errors=False)
    return doomed


def _dead(m: re.Match[str], path: Path) -> bool:
    """Whether the save that left ``path`` (its name matched :data:`_LEFTOVER`) is certainly over."""
    host, boot, ns = _origin()
    if m["host"] != host:
        return False  # another machine's: its pids mean nothing here (a shared file system)
    if m["boot"] != boot:
        # An earlier boot of this host, if the entry is older than this boot; a newer one is
        # another machine with the same host name.
        booted = _boot_time()
        try:
            return booted is not None and path.lstat().st_mtime < booted
        except OSError:
            return False
    if m["ns"] != ns:
        return False  # another pid namespace (a container) on this host
    pid = int(m["pid"])
    return pid != os.getpid() and not _alive(pid)


def remove_stale_temps(parent: Path) -> None:
    """Tidy what saves that are over (killed mid-save) left in ``parent``.

    Temp dirs and temp links go. A ``.NAME.old-*`` copy goes if ``NAME`` is there; if ``NAME`` is
    missing (killed between the two renames of a replace) the newest whole copy is renamed back
    to ``NAME`` first. Only leftovers of this host, boot and pid namespace whose process is gone
    are touched, and those of an earlier boot of this host; never another machine's.
    """
    olds: dict[str, list[tuple[int, Path]]] = {}
    for p in parent.glob(".*-*"):
        m = _LEFTOVER.fullmatch(p.name)
        if m is None or not _dead(m, p):
            continue
        if m["kind"] == "link":
            with contextlib.suppress(OSError):
                os.unlink(p)
        elif m["kind"] == "tmp":
            shutil.rmtree(p, ignore_errors=True)
        else:
            meta = _read_meta_quiet(p)
            olds.setdefault(m["name"], []).append((int(meta.get("saved_at_ns", 0)) if meta else -1, p))
    for name, copies in olds.items():
        copies.sort()
        if not os.path.lexists(parent / name) and copies[-1][0] >= 0:
            with contextlib.suppress(OSError):
                os.rename(copies.pop()[1], parent / name)
                fsync_dir(parent)
        for _, p in copies:
            if os.path.lexists(parent / name):
                _remove_checkpoint(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- reading ------------------------------------------------------------------------------
# A checkpoint folder may come from a stranger: only regular files inside it are read, opened
# without following a link and without blocking (a FIFO would wait forever), never past their size.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def _not_regular(path: Path, mode: int) -> CheckpointError:
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a device or socket"
    )
    return CheckpointError(
        f"{path} is {kind}, not a regular file: a checkpoint holds only regular files inside its folder; "
        "refusing to read it"
    )


def _wrong_size(path: Path, size: int, listed: int) -> CheckpointError:
    return CheckpointError(
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
            raise _wrong_size(path, st.st_size, size)
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


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory at ``path`` (following a ``last`` link); errors say what is there."""
    p = Path(path)
    if p.is_symlink() and not p.exists():  # ``last`` -> NAME while a save replaces NAME: NAME's old copy
        p = p.parent / os.readlink(p)
    if p.is_dir():
        if not os.path.lexists(p / META):  # a meta.json that is not a regular file is refused by read_meta
            raise CheckpointError(
                f"{p} is not a torchrig checkpoint: it has no {META} (a save that was interrupted never "
                "leaves a directory at the final path, so this directory was made by something else)"
            )
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file, but a torchrig checkpoint is a directory holding {META}")
    olds = [(m.get("saved_at_ns", 0), q) for q in _glob(p.parent, f".{p.name}.old-*") if (m := _read_meta_quiet(q))]
    if olds:
        old = max(olds)[1]  # the newest whole copy
        warnings.warn(
            f"{p} is missing because a save was interrupted while replacing it; loading the previous "
            f"checkpoint from {old}",
            stacklevel=3,
        )
        return old
    raise FileNotFoundError(f"no checkpoint at {p}")


def _glob(folder: Path, pattern: str) -> list[Path]:
    return list(folder.glob(pattern)) if folder.is_dir() else []


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


META_LIMIT = 64 << 20  # a meta.json lists files and entries: far below this
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = ("module", "state", "value", "optimizer")
_HIDDEN_FILES = (".metadata",)  # DCP's metadata file: the one hidden name a checkpoint lists


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def plain_key(key: Any) -> bool:
    """A state key: it names files of the checkpoint, so letters, digits, ``_``, ``-``, ``.``, not hidden."""
    return isinstance(key, str) and bool(key) and all(c.isalnum() or c in "_-." for c in key) and key[0] != "."


def confined_name(name: Any) -> bool:
    """A plain file name inside the checkpoint folder: no separator, no ``..``, not absolute, not hidden."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and not any(c in name for c in "/\\\0:")
        and name not in (".", "..", META)
        and (not name.startswith(".") or name in _HIDDEN_FILES)
    )


def validate_meta(meta: Any, source: Path) -> dict[str, Any]:
    """``meta`` (parsed ``meta.json``) if it has the shape torchrig writes; else a :class:`CheckpointError`
    naming the field (``.../meta.json: files['x'].size must be a non-negative integer, got 'x'``).

    Every reader of a checkpoint goes through this one check, so later code can index the
    fields without guarding each one.
    """

    def need(ok: bool, field: str, want: str, got: Any) -> None:
        if not ok:
            raise CheckpointError(f"{source}: {field} must be {want}, got {_shown(got)}; the checkpoint is damaged")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a torchrig checkpoint description (format != {FORMAT!r})")
    version = meta.get("version", 0)
    need(_is_int(version), "version", "a non-negative integer", version)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{source.parent} was written by a newer torchrig (checkpoint format {version}, this one reads "
            f"up to {FORMAT_VERSION}); upgrade torchrig to load it"
        )
    for field, fits, want in (
        ("sharded", lambda v: isinstance(v, bool), "true or false"),
        ("world_size", lambda v: _is_int(v, 1), "a positive integer"),
        ("tensors", _is_int, "a non-negative integer"),
        ("parameters", _is_int, "a non-negative integer"),
        ("buffers", _is_int, "a non-negative integer"),
        ("saved_at_ns", _is_int, "a non-negative integer"),
        ("values", lambda v: isinstance(v, dict), "a JSON object"),
        ("step", lambda v: v is None or isinstance(v, (int, float, str)), "a number, a string or null"),
        ("epoch", lambda v: v is None or isinstance(v, (int, float, str)), "a number, a string or null"),
        *(
            (name, lambda v: v is None or isinstance(v, str), "a string or null")
            for name in ("created", "torch", "torchrig", "device_type", "precision")
        ),
    ):
        if field in meta:
            need(fits(meta[field]), field, want, meta[field])
    files: Any = meta.get("files")
    need(isinstance(files, dict), "files", "a JSON object of file names", files)
    for name, entry in files.items():
        if not confined_name(name):
            raise CheckpointError(
                f"{source}: files lists {name!r}, which is not a plain file name inside the checkpoint folder "
                "(no '/', '..', absolute or hidden names); refusing to read it"
            )
        need(isinstance(entry, dict), f"files[{name!r}]", "a JSON object with size and sha256", entry)
        need(_is_int(entry.get("size")), f"files[{name!r}].size", "a non-negative integer", entry.get("size"))
        sha = entry.get("sha256")
        need(isinstance(sha, str) and bool(_SHA256.fullmatch(sha)), f"files[{name!r}].sha256", "64 hex digits", sha)
    if meta.get("sharded") and _HIDDEN_FILES[0] not in files:  # DCP reads it: it must be checked like the rest
        raise CheckpointError(f"{source}: files must list {_HIDDEN_FILES[0]} in a sharded checkpoint; it is damaged")
    entries: Any = meta.get("entries")
    need(isinstance(entries, dict), "entries", "a JSON object of state keys", entries)
    for key, entry in entries.items():
        where = f"entries[{key!r}]"
        if not plain_key(key):
            raise CheckpointError(f"{source}: {where} is not a plain state key; the checkpoint is damaged")
        need(isinstance(entry, dict), where, "a JSON object with kind and type", entry)
        need(entry.get("kind") in _KINDS, f"{where}.kind", f"one of {', '.join(_KINDS)}", entry.get("kind"))
        need(isinstance(entry.get("type"), str), f"{where}.type", "a string", entry.get("type"))
        need(isinstance(entry.get("dcp", False), bool), f"{where}.dcp", "true or false", entry.get("dcp"))
        if entry["kind"] != "module" or entry.get("dcp"):
            continue
        field = f"{where}.files" if "files" in entry else f"{where}.file"
        listed = entry["files"] if "files" in entry else [entry.get("file")]
        named = isinstance(listed, list) and len(listed) > 0 and all(isinstance(n, str) and n in files for n in listed)
        need(named, field, "names of files listed under files", listed if "files" in entry else entry.get("file"))
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
        entry = self.meta["files"].get(name)  # read_meta checked every listed name is a plain file name
        path = self.folder / name
        if entry is None:
            raise CheckpointError(f"{path} is not listed in {self.folder / META}; the checkpoint is damaged")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; {META} lists it ({entry['size']} bytes)") from None
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if st.st_size != entry["size"]:
            raise _wrong_size(path, st.st_size, entry["size"])
        if hashing and self.verify and name not in self._hashes:
            self._hashes[name] = self._pool.submit(sha256_file, path, entry["size"])
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
        size = self.meta["files"][name]["size"]
        try:
            result, digest = fn(path, self.verify)
        except CheckpointError:
            if self.verify:
                self.compare(name, sha256_file(path, size))
            raise
        except Exception as err:
            if self.verify:  # a damaged file is the likely cause: say so first
                self.compare(name, sha256_file(path, size))
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
