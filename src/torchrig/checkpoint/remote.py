"""Checkpoints on object storage: fsspec URLs (``s3://``, ``gs://``, ``az://``, ``memory://``...).

Object stores cannot rename, so the local rule (write a hidden directory, rename it into place)
becomes: a save stages the checkpoint on the local disk with the very code a local save runs
(:func:`staging`), then uploads every file under a prefix of its own, ``NAME/v-<ordinal>-<random>/``
(:func:`begin`: the time, but above every version already there), and ``meta.json`` (each file's
size and SHA-256) last (:func:`commit`). A sharded save's ranks upload their shards under that
prefix themselves (DCP's fsspec writer, :mod:`.dcp_upload`); rank zero stages and commits the
rest the same way. A version is *committed* when its ``meta.json`` exists; readers follow only
the newest committed version of ``NAME`` (:func:`locate`). ``last`` is one small object next to
the checkpoints holding the name it points at, written after the commit. Older versions of
``NAME`` (committed, or left by a killed save) are deleted only after that, ``meta.json`` first,
then ``keep_last`` deletes the checkpoints beside it least far in training, in the order of a
local folder (step, then ``save_count``; never a clock); a crash at any point leaves the previous
``last`` loadable. A read downloads the committed files to a private local temp folder, hashing
each as its bytes arrive, and reads them there as a local load does (:func:`fetched`): the reader
compares those digests with ``meta.json`` before anything is parsed or filled, so every guarantee
of the reader holds unchanged, and no file is read back only to be hashed; a reader that needs
only some of them (a rank of a sharded load: its own shards) names them, and the rest are never
downloaded (:func:`fetch_listed`).

``file://`` URLs are local paths and take the local code path (:func:`local_path`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.failures import link_not_moved, not_pruned
from torchrig.checkpoint.files import HashingWriter, resolve_checkpoint
from torchrig.checkpoint.meta import META, META_LIMIT
from torchrig.checkpoint.progress import least_advanced, next_save_count
from torchrig.checkpoint.reading import hashed_on_arrival, read_meta, read_meta_quiet, wrong_size

_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
_VERSION = re.compile(r"v-[0-9]{20}-[0-9a-f]{8}")
POINTER_LIMIT = 4096  # a ``last`` object holds one checkpoint name
_STAGE_PREFIX = "torchrig-stage-"
# What each open fetched() folder has still to download on request: folder -> fetch(names).
_LATER: dict[str, Callable[[Collection[str]], None]] = {}  # keyed by the folder's real path


class CheckpointURL(str):
    """The URL of a checkpoint on object storage (what ``rig.save("s3://...")`` returns): a ``str``
    with the two parts of a path torchrig uses, :attr:`name` and :attr:`parent`."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> CheckpointURL:
        return CheckpointURL(self.rstrip("/").rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> CheckpointURL:
        return CheckpointURL(f"{self.rstrip('/')}/{name}")


def local_path(path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``path`` with a ``file://`` scheme taken off (a local path); anything else as it is."""
    text = os.fspath(path)
    if isinstance(text, str) and text.startswith("file://"):
        return text[len("file://") :]
    return path


def lexists(path: Path | CheckpointURL) -> bool:
    """Whether anything is at ``path`` (a link that points nowhere, an object or prefix at a URL)."""
    if isinstance(path, CheckpointURL):
        fs, root = _filesystem(path)
        return bool(fs.exists(root))
    return os.path.lexists(path)


def holds_checkpoint(path: Path | CheckpointURL) -> bool:
    """Whether a torchrig checkpoint is at ``path``: a real directory (not a link) holding a valid
    ``meta.json``, or a name on object storage with a committed version."""
    if isinstance(path, CheckpointURL):
        fs, root = _filesystem(path)
        return any(_cat(fs, f"{v}/{META}", 0) is not None for v in _versions(fs, root))
    return path.is_dir() and not path.is_symlink() and read_meta_quiet(path) is not None


def as_url(path: Any) -> CheckpointURL | None:
    """``path`` as a :class:`CheckpointURL` if it is an object-store URL (not ``file://``), else None."""
    if isinstance(path, os.PathLike):
        return None
    if not isinstance(path, str):
        return None
    m = _SCHEME.match(path)
    if m is None or m["scheme"].lower() == "file":
        return None
    return CheckpointURL(path.rstrip("/"))


def _filesystem(url: CheckpointURL) -> tuple[Any, str]:
    """fsspec's file system for ``url`` and the path on it; a missing backend says what to install."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"saving to or loading from {url} needs fsspec: pip install 'torchrig[remote]' "
            "(fsspec and s3fs; gcsfs for gs://, adlfs for az://)"
        ) from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise ImportError(
            f"fsspec cannot open {url}: {err} (s3:// needs s3fs, gs:// gcsfs, az:// adlfs: "
            "pip install 'torchrig[remote]' or the backend for your store)"
        ) from None
    fs.invalidate_cache()  # listings cached by an earlier call miss what other processes wrote since
    return fs, root.rstrip("/")


def _children(fs: Any, prefix: str) -> list[str]:
    """The names directly under ``prefix`` (objects and prefixes), sorted; none where nothing is."""
    try:
        found = fs.ls(prefix, detail=False)
    except FileNotFoundError:
        return []
    return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in found})


def _versions(fs: Any, prefix: str) -> list[str]:
    """The version prefixes under a checkpoint name, oldest first (their names sort by time)."""
    return [f"{prefix}/{n}" for n in _children(fs, prefix) if _VERSION.fullmatch(n)]


def _cat(fs: Any, path: str, limit: int) -> bytes | None:
    """The bytes of the object at ``path``, at most ``limit + 1`` of them (one ranged GET); None
    where there is no such object (nothing, or only a prefix)."""
    try:
        return bytes(fs.cat_file(path, start=0, end=limit + 1))
    except (FileNotFoundError, IsADirectoryError):
        return None


def _pointed(raw: bytes, url: str) -> str:
    """The checkpoint name a ``last`` object holds (one plain name: it never leads out of its folder)."""
    if len(raw) > POINTER_LIMIT:
        raise CheckpointError(f"{url} is over {POINTER_LIMIT} bytes: a torchrig link object holds one checkpoint name")
    try:
        name = json.loads(raw)["checkpoint"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{url} is not a torchrig link object (expected JSON {{'checkpoint': NAME}}: {err!r}); "
            "pass the checkpoint's own URL"
        ) from None
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise CheckpointError(f"{url} names {name!r}, which is not a checkpoint name in its folder")
    return name


def locate(url: CheckpointURL) -> tuple[Any, str, CheckpointURL, bytes]:
    """The newest committed version of the checkpoint at ``url`` (following a ``last`` object).

    Returns the file system, its path there, its URL and the bytes of its ``meta.json``. A
    version without ``meta.json`` (a save under way, or killed) is never read.
    """
    fs, root = _filesystem(url)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-locate") as pool:
        listed = pool.submit(_versions, fs, root)  # a checkpoint's own name: its versions, at the same time
        pointer = _cat(fs, root, POINTER_LIMIT)  # ... as a ``last`` object of that name is looked for
        versions = listed.result()
    if pointer is not None:
        versions = _versions(fs, f"{root.rsplit('/', 1)[0]}/{_pointed(pointer, url)}")
    for version in reversed(versions):
        meta = _cat(fs, f"{version}/{META}", META_LIMIT)
        if meta is not None:
            return fs, version, CheckpointURL(fs.unstrip_protocol(version)), meta
    if versions:
        raise CheckpointError(
            f"no committed checkpoint at {url}: {len(versions)} upload(s) under it never wrote their {META} "
            "(a save that was interrupted, or one still under way); load an earlier checkpoint"
        )
    raise FileNotFoundError(f"no checkpoint at {url}")


@contextlib.contextmanager
def fetched(
    path: str | os.PathLike[str], names: Callable[[dict[str, Any]], Collection[str]] | None = None
) -> Iterator[Path]:
    """The checkpoint folder at ``path`` to read: a local one as it is (:func:`resolve_checkpoint`);
    one on object storage downloaded to a temp folder (removed afterwards): its ``meta.json``
    first, checked against the schema, then only the files it lists: every one, or with ``names``
    the ones ``names(meta)`` returns; the others come only if a reader asks (:func:`fetch_listed`).
    Each is hashed as its bytes arrive (:func:`_download`), and the reader compares those digests
    with ``meta.json`` (:func:`~torchrig.checkpoint.reading.hashed_on_arrival`) instead of reading
    every file twice."""
    url = as_url(path)
    if url is None:
        yield resolve_checkpoint(local_path(path))
        return
    fs, version, origin, raw = locate(url)
    with staging() as folder:
        try:
            (folder / META).write_bytes(raw)
            meta = read_meta(folder)  # the names it lists are plain file names (checked)
            listed: dict[str, dict[str, Any]] = meta["files"]
            first = listed if names is None else {n: listed[n] for n in names(meta) if n in listed}
            arrived = _download(fs, version, origin, first, folder)

            def later(wanted: Collection[str]) -> None:
                rest = {n: listed[n] for n in sorted(wanted) if n in listed and not os.path.lexists(folder / n)}
                arrived.update(_download(fs, version, origin, rest, folder))

            _LATER[os.path.realpath(folder)] = later
            with hashed_on_arrival(folder, arrived):  # the readers see what ``later`` adds
                yield folder
        except CheckpointError as err:  # the reader's refusal names the stored object, not a temp copy
            staged = re.escape(os.path.join(tempfile.gettempdir(), _STAGE_PREFIX)) + "[A-Za-z0-9_]+"
            text = re.sub(staged, lambda _: origin, str(err))  # this rank's temp folder, or another rank's (sharded)
            if text == str(err):
                raise
            raise CheckpointError(text).with_traceback(err.__traceback__) from None
        finally:
            _LATER.pop(os.path.realpath(folder), None)


def fetch_listed(folder: Path, names: Collection[str]) -> None:
    """Download the files ``names`` (listed in its ``meta.json``) of a checkpoint :func:`fetched`
    yielded as ``folder`` that are not there yet; nothing for a local folder (all its files are)."""
    later = _LATER.get(os.path.realpath(folder))
    if later is not None:
        later(names)


_DOWNLOAD_CHUNK = 1 << 20  # bytes asked for per read of a download: few Python steps, little memory
_DOWNLOADS = 8  # objects downloaded at once


def _download(fs: Any, version: str, origin: str, files: dict[str, dict[str, Any]], folder: Path) -> dict[str, str]:
    """The objects ``files`` lists, from ``version`` into ``folder``, all at once; the SHA-256 of
    each, taken from its bytes as they arrived (hashlib releases the GIL: the hashes run beside
    the transfers). One that is gone is refused as a local load refuses a missing file (the
    checkpoint was changed after its commit); one of another size than ``meta.json`` says, as a
    local load refuses it, before anything is read."""
    names = list(files)
    if not names:
        return {}
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=min(_DOWNLOADS, len(names)), thread_name_prefix="torchrig-download")
    try:
        jobs = {
            n: pool.submit(_download_one, fs, f"{version}/{n}", folder / n, files[n]["size"], f"{origin}/{n}", stop)
            for n in names
        }
        digests, missing = {}, []
        for n, job in jobs.items():
            try:
                digests[n] = job.result()
            except FileNotFoundError:
                missing.append(n)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                raise OSError(
                    errno.ENOSPC,
                    f"no space left on device in {folder} for {origin}/{n} ({files[n]['size']} bytes): a checkpoint "
                    "on object storage is downloaded there to be read (TMPDIR sets that folder); make room or set "
                    "TMPDIR to a disk with space",
                ) from err
    except BaseException as err:
        stop.set()  # the other transfers end at their next piece; Ctrl-C does not wait even for that
        pool.shutdown(wait=isinstance(err, Exception), cancel_futures=True)
        raise
    pool.shutdown()
    if missing:
        raise CheckpointError(
            f"{origin}/{missing[0]} is missing; {META} lists it ({files[missing[0]]['size']} bytes): the "
            f"checkpoint was changed after its commit ({len(missing)} missing of the {len(names)} files fetched); "
            "load an earlier checkpoint"
        )
    return digests


def _download_one(fs: Any, path: str, local: Path, size: int, shown: str, stop: threading.Event) -> str:
    """The object at ``path`` into the new file ``local``: at most ``size + 1`` bytes read (one
    more than ``meta.json`` lists, to see an object that grew), each piece hashed and written on
    a second thread while the next one arrives; its SHA-256 (nothing once ``stop`` is set: another
    download failed)."""
    done = 0
    with (
        _streamed(fs, path) as read,
        open(local, "xb") as f,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-hash") as pool,
    ):
        _reserve(f, size)
        out = HashingWriter(f)
        written: Future[int] | None = None
        while done <= size:
            chunk = read(min(_DOWNLOAD_CHUNK, size + 1 - done))
            if not chunk:
                break
            if stop.is_set():
                return ""
            if written is not None:
                written.result()
            written = pool.submit(out.write, chunk)
            done += len(chunk)
        if written is not None:
            written.result()
        digest = out.hexdigest()
    if done != size:
        raise wrong_size(shown, done if done < size else int(fs.size(path)), size)
    return digest


def _reserve(f: Any, size: int) -> None:
    """Allocate the ``size`` bytes a download will write to the file ``f`` before it starts: a disk
    too full for it fails at once (``ENOSPC``), and the writes that follow cost the file system
    less. Where the file system cannot allocate ahead, the writes allocate as they go."""
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(f.fileno(), 0, size)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise
        # EOPNOTSUPP/EINVAL: a file system without it


@contextlib.contextmanager
def _streamed(fs: Any, path: str) -> Iterator[Callable[[int], bytes]]:
    """``read(n)`` of the object at ``path``, from its start: one request streamed through fsspec's
    ``open_async`` where the backend has it (``s3fs``: one GET, as its ``get`` makes), else its
    file object (``memory://``, or a backend reading by ranges)."""
    if getattr(fs, "async_impl", False):
        from fsspec.asyn import sync

        try:
            stream = sync(fs.loop, fs.open_async, path, "rb")
        except NotImplementedError:
            stream = None
        if stream is not None:
            try:
                yield lambda n: sync(fs.loop, stream.read, n)
            finally:  # (a download stopped early, or of an object that grew, leaves its stream unread)
                sync(fs.loop, stream.close)
            return
    with fs.open(path, "rb") as f:
        yield f.read


def remote_origin(path: str | os.PathLike[str]) -> str | None:
    """The URL of the committed version ``path`` names, if it is on object storage."""
    url = as_url(path)
    return None if url is None else locate(url)[2]


@contextlib.contextmanager
def staging() -> Iterator[Path]:
    """A private local temp folder for a checkpoint on its way to or from object storage."""
    folder = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _remove(fs: Any, prefix: str) -> None:
    """Delete an uploaded version, ``meta.json`` first: a half-deleted one is never taken for whole."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(f"{prefix}/{META}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(prefix, recursive=True)


def check_target(target: CheckpointURL, link: str | None) -> list[str]:
    """Refuse to save at ``target`` unless nothing is there or a torchrig checkpoint is (only its
    version prefixes ``v-<ordinal>-<random>/``), and, with ``link``, unless that name beside it is
    missing or a torchrig link object: anything else is the user's and is never written over, nor
    later deleted by retention. Returns the version prefixes already under ``target``."""
    fs, root = _filesystem(target)
    if fs.isfile(root):  # an object store keeps an object NAME beside the prefix NAME/: loads would read it
        raise CheckpointError(
            f"cannot save to {target}: an object of that name is there, and it is not a torchrig checkpoint "
            f"(one on object storage is the prefix {target}/, its objects under it); remove the object or "
            "save under another name"
        )
    children = _children(fs, root)
    foreign = [n for n in children if not _VERSION.fullmatch(n)]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise CheckpointError(
            f"cannot save to {target}: the prefix {target}/ holds objects that are not a torchrig checkpoint's "
            f"({shown}); only a new name or a torchrig checkpoint (its v-<ordinal>-<random>/ versions) is "
            "replaced: give a new name such as 'step-000100', or remove them yourself"
        )
    if link is not None:
        at = f"{root.rsplit('/', 1)[0]}/{link}"
        if fs.isdir(at):
            raise CheckpointError(
                f"cannot update the {link!r} link: {target.parent / link} holds objects (it is not a torchrig "
                "link object); remove them or pass link=None"
            )
        raw = _cat(fs, at, POINTER_LIMIT)
        try:
            if raw is not None:
                _pointed(raw, at)
        except CheckpointError:
            raise CheckpointError(
                f"cannot update the {link!r} link: {target.parent / link} is an object that is not a torchrig "
                f"link object (JSON {{'checkpoint': NAME}}), it holds something else; "
                "remove it or pass link=None"
            ) from None
    return [f"{root}/{n}" for n in children]


def begin(target: CheckpointURL, link: str | None) -> str:
    """A new save of ``target``: ``target`` itself and the ``link`` beside it checked
    (:func:`check_target`: refused before anything is written), and the name of the version
    prefix its files go under, ``v-<ordinal>-<random>``. The ordinal is the save's time in ns, but
    always above every version already under the name (a clock that jumped back never hides the
    new version)."""
    versions = check_target(target, link)
    after = int(versions[-1].rsplit("/", 1)[-1][2:22]) + 1 if versions else 0
    return f"v-{max(time.time_ns(), after):020d}-{uuid.uuid4().hex[:8]}"


def abandon(target: CheckpointURL, version: str) -> None:
    """Delete what a save that failed uploaded under ``version`` of ``target``, unless it was
    committed (a failure after its ``meta.json``: the link, retention) and is the checkpoint now."""
    fs, root = _filesystem(target)
    if _cat(fs, f"{root}/{version}/{META}", 0) is None:
        _remove(fs, f"{root}/{version}")


def uploaded(target: CheckpointURL, version: str, name: str) -> bytes:
    """The bytes of the file ``name`` a save (not yet committed) uploaded under ``version`` of ``target``."""
    fs, root = _filesystem(target)
    return bytes(fs.cat_file(f"{root}/{version}/{name}"))


_UPLOADS = 8  # files uploaded at once


class Upload:
    """One save of a whole checkpoint on its way to ``target``: its version prefix chosen first
    (:func:`begin`: a refused name is refused before anything is written), each staged file
    uploaded as soon as it is written (:meth:`send`, beside the writing of the others; the staged
    copy removed once it is up), what is left and ``meta.json`` last (:meth:`commit`). Leaving
    with an error deletes what was uploaded: nothing was committed.

    Example:
        >>> # with staging() as staged, Upload(url, "last") as up:
        >>> #     up.commit(staged, fill(staged, written=up.send), keep_last=None)
    """

    def __init__(self, target: CheckpointURL, link: str | None) -> None:
        self.target, self.link = target, link
        self.version = begin(target, link)
        self._fs, root = _filesystem(target)  # one file system for every upload of the save
        self._prefix = f"{root}/{self.version}"
        self._pool = ThreadPoolExecutor(max_workers=_UPLOADS, thread_name_prefix="torchrig-upload")
        self._sent: list[Future[None]] = []

    def send(self, path: Path) -> None:
        """Start uploading the staged file ``path`` (it is removed once uploaded)."""
        self._sent.append(self._pool.submit(self._put, path))

    def _put(self, path: Path) -> None:
        self._fs.put_file(str(path), f"{self._prefix}/{path.name}")
        path.unlink()

    def commit(self, staged: Path, meta: dict[str, Any], *, keep_last: int | None) -> None:
        """Once every file sent is up (the first failure raised), :func:`commit` the rest of ``staged``."""
        for job in self._sent:
            job.result()
        commit(staged, self.target, meta, link=self.link, keep_last=keep_last, version=self.version)

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._pool.shutdown()
            return
        # The other uploads stop; Ctrl-C does not wait for those under way (what one of them
        # finishes after the clean-up is an uncommitted leftover the next save of the name removes).
        self._pool.shutdown(wait=issubclass(kind, Exception), cancel_futures=True)
        abandon(self.target, self.version)


def commit(
    staged: Path,
    target: CheckpointURL,
    meta: dict[str, Any],
    *,
    link: str | None,
    keep_last: int | None,
    version: str | None = None,
) -> None:
    """Upload the finished checkpoint folder ``staged`` as ``target``: its files under the prefix
    ``version`` (a new one by default; a sharded save's shards, or the files an :class:`Upload`
    sent, are already there and gone from ``staged``), ``meta`` as
    ``meta.json`` last; then the ``link`` object; then older versions and, with ``keep_last``, the
    checkpoints least far in training next to it go (:func:`~torchrig.checkpoint.progress.least_advanced`,
    the order of a local save)."""
    fs, root = _filesystem(target)
    prefix = f"{root}/{version if version is not None else begin(target, link)}"
    names = sorted(p.name for p in staged.iterdir() if p.name != META)
    try:
        if names:
            fs.put([str(staged / n) for n in names], [f"{prefix}/{n}" for n in names])
        beside = _committed_beside(fs, root)
        meta["save_count"] = next_save_count(m for m, _ in beside)  # the order of saves here, not a clock
        (staged / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        fs.put_file(str(staged / META), f"{prefix}/{META}")  # the commit
    except BaseException:
        _remove(fs, prefix)  # nothing of an upload that failed stays
        raise
    # Committed: what fails from here on says so, and nothing deletes the new version.
    if link is not None:
        at = f"{root.rsplit('/', 1)[0]}/{link}"
        try:
            fs.pipe_file(at, json.dumps({"checkpoint": target.name}).encode())
        except Exception as err:
            raise link_not_moved(target, link, _still_pointed(fs, at), err) from err
    try:
        for old in _versions(fs, root):
            if old < prefix:
                _remove(fs, old)
        if keep_last is not None:
            for name in least_advanced(beside, keep_last):
                _remove_name(fs, name)
    except Exception as err:
        raise not_pruned(target, link, keep_last, err) from err


def _still_pointed(fs: Any, at: str) -> str | None:
    """The name the ``last`` object at ``at`` holds after a write of it failed (None: none, or unknown)."""
    try:
        raw = _cat(fs, at, POINTER_LIMIT)
        return None if raw is None else _pointed(raw, at)
    except Exception:
        return None


def _committed_beside(fs: Any, root: str) -> list[tuple[dict[str, Any], str]]:
    """The names next to ``root`` holding a committed torchrig checkpoint (``root`` and hidden names
    left out), each with the ``meta.json`` of its newest committed version.

    Two requests whatever the number of checkpoints: one listing of every object under the folder
    (one paginated LIST on S3), then the ``meta.json`` objects fetched concurrently.
    """
    parent = root.rsplit("/", 1)[0]
    newest: dict[str, str] = {}
    for key in fs.find(parent):
        parts = key.rstrip("/")[len(parent) + 1 :].split("/")  # NAME, VERSION, meta.json
        if len(parts) != 3 or parts[2] != META or not _VERSION.fullmatch(parts[1]) or parts[0].startswith("."):
            continue
        name = f"{parent}/{parts[0]}"
        if name != root and f"{name}/{parts[1]}" > newest.get(name, ""):
            newest[name] = f"{name}/{parts[1]}"
    if not newest:
        return []
    raw = fs.cat([f"{v}/{META}" for v in newest.values()], on_error="omit")  # one removed meanwhile: left out
    found = []
    for name, version in newest.items():
        try:
            meta = json.loads(raw[f"{version}/{META}"])
        except (KeyError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("format") is not None:
            found.append((meta, name))
    return found


def _remove_name(fs: Any, prefix: str) -> None:
    """Delete every version of a checkpoint name, each ``meta.json`` first, then what is left of the
    name (the folders of a store that keeps them) if no object is under it: an object someone
    put there stays. (Not ``rmdir``: gcsfs's deletes the bucket.)"""
    for version in _versions(fs, prefix):
        _remove(fs, version)
    if not fs.find(prefix):
        with contextlib.suppress(FileNotFoundError):
            fs.rm(prefix, recursive=True)


def remove_checkpoint(url: CheckpointURL) -> None:
    """Delete every version of the checkpoint at ``url`` (for a callback's retention)."""
    fs, root = _filesystem(url)
    _remove_name(fs, root)
