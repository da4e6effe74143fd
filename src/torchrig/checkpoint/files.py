"""Files of a checkpoint: durable writes, checksums, atomic commit, links, retention, leftovers.

Nothing here knows about models or optimizers: it moves bytes and guarantees that a directory
at the final path is either complete (every file fsynced and listed with its SHA-256 in
``meta.json``) or not there at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import io
import json
import os
import re
import shutil
import socket
import sys
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.failures import link_not_moved, not_pruned
from torchrig.checkpoint.meta import META
from torchrig.checkpoint.progress import checkpoints_beside, least_advanced, next_save_count, progress
from torchrig.checkpoint.reading import not_a_checkpoint, read_meta_quiet, sha256_file
from torchrig.checkpoint.targets import NAME_MAX, check_link, check_target

_CHUNK = 16 << 20


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
    """A write-only file (a local one, or an upload stream of fsspec's) that hashes what passes
    through, the hash beside the write.

    ``torch.save`` hands over each tensor's bytes in one call, valid only during it: large
    buffers are hashed on a second thread (hashlib releases the GIL) while this one writes them.
    """

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f = f
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-hash")
        self.size = 0  # bytes written

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return int(self._f.tell())

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.size += view.nbytes
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


def write_torch(path: Path, fsync: bool, obj: Any) -> str:
    """``torch.save`` into ``path`` (fsynced with ``fsync``); returns the SHA-256 of the bytes written."""
    with open(path, "xb") as f:
        writer = HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]
        digest = writer.hexdigest()
        f.flush()
    if fsync:
        durable(path)
    return digest


class FileSet:
    """Writes the files of one checkpoint into ``folder`` in parallel; each job returns its SHA-256.

    ``fsync=False`` for a folder that is only staged for an upload (object storage makes the
    checkpoint durable, and the folder is removed after it): its files are not fsynced. With
    ``written``, ``written(path)`` is called on the writing thread as soon as a file is written
    and hashed (a staged file's upload starts there, beside the writing of the others).

    Example:
        >>> # with FileSet(tmp) as fs: fs.add("state.pt", functools.partial(write_torch, obj=obj)); fs.finish()
    """

    def __init__(
        self,
        folder: Path,
        *,
        workers: int = 4,
        fsync: bool = True,
        written: Callable[[Path], None] | None = None,
    ) -> None:
        self.folder = folder
        self.fsync = fsync
        self._written = written
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="torchrig-ckpt")
        self._jobs: dict[str, Future[dict[str, Any]]] = {}

    def add(self, name: str, write: Callable[[Path, bool], str]) -> None:
        """Run ``write(path, fsync) -> sha256`` on a worker thread."""
        self._jobs[name] = self._pool.submit(self._write, self.folder / name, write)

    def _write(self, path: Path, write: Callable[[Path, bool], str]) -> dict[str, Any]:
        entry = {"sha256": write(path, self.fsync), "size": path.stat().st_size}
        if self._written is not None:
            self._written(path)
        return entry

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait for every write (re-raising the first error, ENOSPC included); the files table."""
        return {name: job.result() for name, job in self._jobs.items()}

    def __enter__(self) -> FileSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def hash_existing(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of files already written into ``folder`` (by DCP on every rank)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        digests = list(pool.map(lambda n: sha256_file(folder / n), names))
    return {n: {"size": (folder / n).stat().st_size, "sha256": d} for n, d in zip(names, digests, strict=True)}


def write_meta(folder: Path, meta: dict[str, Any], target: Path) -> None:
    """``meta.json`` goes last: its presence is what makes a directory a checkpoint.

    It records ``save_count``, one more than any checkpoint beside ``target`` has: the order of
    saves in that folder, which ranks checkpoints of the same step (:func:`progress`), whatever
    the clocks of the machines that wrote them say.
    """
    meta["save_count"] = next_save_count(m for m, _ in checkpoints_beside(target))
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


# What a leftover name adds to NAME, at most: ``.`` NAME ``.link-`` 3 x 8 hex and 2 dots, ``-PID`` (7
# digits: Linux's largest pid), ``-`` 8 hex.
_LEFTOVER_EXTRA = 1 + 6 + 26 + 8 + 9


def _stem(name: str) -> str:
    """``name`` as leftover names carry it: whole where the longest leftover name still fits in
    :data:`NAME_MAX` bytes, else cut, with ``~`` and a hash of the whole name (the same in every
    process, so a leftover of a long name is found again by that name)."""
    room = NAME_MAX - _LEFTOVER_EXTRA
    if len(os.fsencode(name)) <= room:
        return name
    cut = name
    while len(os.fsencode(cut)) > room - 9:
        cut = cut[:-1]
    return f"{cut}~{_tag(name)}"


def leftover_name(target: Path, kind: str) -> Path:
    """A fresh ``.NAME.KIND-OWNER-RANDOM`` path next to ``target`` (see :data:`_LEFTOVER`); it fits in
    a file name whenever ``target``'s name does (a long NAME is cut, see :func:`_stem`)."""
    host, boot, ns = _origin()
    owner = f"{host}.{boot}.{ns}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return target.parent / f".{_stem(target.name)}.{kind}-{owner}"


def temp_dir_for(target: Path) -> Path:
    """A fresh hidden directory next to ``target`` (same file system, so the rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = leftover_name(target, "tmp")
    tmp.mkdir()
    return tmp


def prepare_target(target: Path, link: str | None) -> Path:
    """Check ``target`` (:func:`check_target`) and the ``link`` beside it, tidy what dead saves left
    there, and make the temp directory the checkpoint is written into; nothing is written when
    either is refused."""
    check_target(target, link)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent, named=target.name)
    return temp_dir_for(target)


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
    check_target(target)  # again: something else may have been put there while the files were written
    if not os.path.lexists(target):
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


def publish(tmp: Path, target: Path, meta: dict[str, Any], *, link: str | None, keep_last: int | None) -> None:
    """The end of every save, whole or sharded: ``meta.json`` into the finished ``tmp``, the commit
    to ``target``, then the ``link`` and ``keep_last``. A failure after the commit is a
    :class:`CheckpointError` saying that the checkpoint was committed and where the link points."""
    write_meta(tmp, meta, target)
    commit(tmp, target)
    if link:
        where = target.parent / link
        before = os.readlink(where) if where.is_symlink() else None
        try:
            update_link(target, link)
        except (OSError, CheckpointError) as err:
            raise link_not_moved(target, link, before, err) from err
    if keep_last is not None:
        try:
            apply_retention(target, keep_last)
        except OSError as err:
            raise not_pruned(target, link, keep_last, err) from err


def update_link(target: Path, name: str) -> None:
    """Point ``target.parent / name`` at ``target`` by replacing a temporary symlink over it."""
    link = target.parent / name
    check_link(link)
    tmp = leftover_name(link, "link")
    os.symlink(target.name, tmp, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(target.parent)


def apply_retention(target: Path, keep_last: int) -> list[Path]:
    """Delete the checkpoints next to ``target`` least far in training (:func:`progress`: step, then
    the order of saves) so that ``keep_last`` remain; returns them.

    Only visible sibling directories holding a torchrig ``meta.json`` count; ``target`` is kept.
    Another process may save and prune in the same folder: a checkpoint it removed meanwhile is
    simply no longer counted.
    """
    doomed = least_advanced(checkpoints_beside(target), keep_last)
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


def remove_stale_temps(parent: Path, *, named: str | None = None) -> None:
    """Tidy what saves that are over (killed mid-save) left in ``parent``.

    Temp dirs and temp links go. A ``.NAME.old-*`` copy goes if ``NAME`` is there; if ``NAME`` is
    missing (killed between the two renames of a replace) the newest whole copy is renamed back
    to ``NAME`` first. Only leftovers of this host, boot and pid namespace whose process is gone
    are touched, and those of an earlier boot of this host; never another machine's. A NAME too
    long to carry whole (:func:`_stem`) is known again only as ``named`` (the name being saved).
    """
    olds: dict[str, list[tuple[tuple[int, float, int], Path]]] = {}
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
            olds.setdefault(m["name"], []).append((progress(read_meta_quiet(p)), p))
    for stem, copies in olds.items():
        name = named if named is not None and stem == _stem(named) else stem  # a long name's is cut
        copies.sort(key=lambda c: c[0])
        if not os.path.lexists(parent / name) and copies[-1][0][0] >= 0:  # the newest whole copy
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


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory at ``path``, a ``last`` link followed once, here (a reader opens
    the files of the checkpoint it named, even if the link moves meanwhile); errors say what is there."""
    p = Path(path)
    for _ in range(_LINKS):
        if not p.is_symlink():
            break
        p = p.parent / os.readlink(p)  # ``last`` -> NAME, NAME itself even while a save replaces it
    if p.is_dir():
        if not os.path.lexists(p / META):  # a meta.json that is not a regular file is refused by read_meta
            raise CheckpointError(
                f"{p} is not a torchrig checkpoint: it has no {META} (a save that was interrupted never "
                "leaves a directory at the final path, so this directory was made by something else)"
            )
        return p
    if p.exists():
        raise CheckpointError(not_a_checkpoint(p))
    copies = _glob(p.parent, f".{glob.escape(_stem(p.name))}.old-*")
    olds = [(progress(m), q) for q in copies if (m := read_meta_quiet(q))]
    if olds:
        old = max(olds, key=lambda o: o[0])[1]  # the newest whole copy
        warnings.warn(
            f"{p} is missing because a save was interrupted while replacing it; loading the previous "
            f"checkpoint from {old}",
            stacklevel=3,
        )
        return old
    raise FileNotFoundError(f"no checkpoint at {p}")


_LINKS = 40  # links followed at most (the kernel's own limit)


def folder_identity(folder: Path) -> tuple[int, int, int] | None:
    """What says ``folder`` is still the directory it was (None when it is gone): a save that
    replaces a checkpoint swaps a new directory in under the same name. Its device, inode and
    change time: a file system may give a new directory the inode number of one just removed."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _glob(folder: Path, pattern: str) -> list[Path]:
    return list(folder.glob(pattern)) if folder.is_dir() else []
