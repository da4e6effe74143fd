"""What a failed save says: a :class:`CheckpointError` telling whether the checkpoint was committed,
and for a full disk how much room it needs and whether space or inodes ran out."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torchrig.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from torchrig.checkpoint.remote import CheckpointURL


@contextlib.contextmanager
def uncommitted(
    target: Path | CheckpointURL, needed: Callable[[], int], *, staged: Path | None = None
) -> Iterator[None]:
    """Turn a failure of a save before its commit into a :class:`CheckpointError` that says so and
    that nothing was replaced (a full disk or no inodes named as such, with ``needed()`` bytes: of
    the local folder ``staged`` where a checkpoint on object storage is staged for its upload).

    Refusals (``CheckpointError``, ``TypeError`` and ``ValueError`` about the state or the path),
    errors after the commit (:func:`torchrig.checkpoint.files.publish`) and interrupts pass through as they are.
    """
    try:
        yield
    except BaseException as err:
        failure = _not_committed(err, target, needed, staged)
        if failure is None:
            raise
        raise failure from err


def _not_committed(
    err: BaseException, target: Path | CheckpointURL, needed: Callable[[], int], staged: Path | None
) -> CheckpointError | None:
    if isinstance(err, CheckpointError):  # a refusal, or a failure after the commit saying so
        return None
    if _no_space(err):
        if staged is None:
            return _no_space_error(target.parent, target, needed())
        where = f"{staged}, where {target} is staged for its upload (TMPDIR sets that folder)"
        return _no_space_error(staged, where, needed())
    dcp = sys.modules.get("torch.distributed.checkpoint.api")  # DCP's CheckpointException, a BaseException
    dcp_failure = dcp is not None and isinstance(err, dcp.CheckpointException)
    if isinstance(err, (TypeError, ValueError)) or not (isinstance(err, (OSError, RuntimeError)) or dcp_failure):
        return None
    return CheckpointError(
        f"saving {target} failed before the checkpoint was committed ({type(err).__name__}: {err}); "
        "nothing was replaced (the previous checkpoint and the link are as they were)"
    )


def _no_space(err: BaseException | None) -> bool:
    """Whether ``err`` or an error it was raised from is a full disk (or quota): torch reports one as
    ``unexpected pos`` with the ``OSError`` as its context, safetensors as ``(os error 28)``."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if f"(os error {errno.ENOSPC})" in str(err) or f"(os error {errno.EDQUOT})" in str(err):
            return True
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (error, traceback)}
        causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
        if any(isinstance(c, BaseException) and _no_space(c) for c in causes):
            return True
        err = err.__cause__ or err.__context__
    return False


_FEW_INODES = 1024  # fewer free than this after a save failed for want of space: inodes ran out


def _no_space_error(disk: Path | CheckpointURL, where: object, needed: int) -> CheckpointError:
    """What a full disk says: the room the checkpoint needs and what is free on the disk of the
    folder ``disk``, in bytes and inodes (measured once the temp directory is gone), naming
    ``where``; with bytes to spare, it ran out of inodes (or a quota)."""
    nothing = "nothing was replaced (the previous checkpoint and the link are as they were)"
    try:
        st = os.statvfs(disk)
    except (OSError, AttributeError):  # no statvfs on Windows
        try:
            free_bytes: int | None = shutil.disk_usage(disk).free
        except OSError:
            free_bytes = None
        inodes = None
    else:
        free_bytes, inodes = st.f_bavail * st.f_frsize, (st.f_favail if st.f_files else None)
    if free_bytes is None:
        return CheckpointError(
            f"no space left on device at {where}: the checkpoint needs about {needed / 1e6:.1f} MB, "
            f"free space unknown; {nothing}"
        )
    free = f"{free_bytes / 1e6:.1f} MB free"
    if free_bytes > needed and inodes is not None and inodes < _FEW_INODES:
        return CheckpointError(
            f"no space left on device at {where}: the file system is out of inodes (room for new files and "
            f"directories, see `df -i`: {inodes} free), not of space ({free}, the checkpoint needs about "
            f"{needed / 1e6:.1f} MB); remove files there or save elsewhere; {nothing}"
        )
    return CheckpointError(
        f"no space left on device at {where}: the checkpoint needs about {needed / 1e6:.1f} MB, {free}; {nothing}"
    )


def link_not_moved(target: Path | CheckpointURL, link: str, pointed: str | None, err: BaseException) -> CheckpointError:
    """What a save says when its checkpoint was committed but the ``link`` beside it was not moved
    to it (``pointed``: the name the link still points at, None where there was none)."""
    was = f"still points at {pointed!r}" if pointed is not None else "was not made"
    return CheckpointError(
        f"the checkpoint {target} was committed, but the {link!r} link was not moved to it "
        f"({type(err).__name__}: {err}); {target.parent / link} {was}. Load {target} by its name; the next save "
        "moves the link"
    )


def not_pruned(
    target: Path | CheckpointURL, link: str | None, keep_last: int | None, err: BaseException
) -> CheckpointError:
    """What a save says when its checkpoint was committed (and the ``link`` moved to it) but removing
    what it replaced, or the checkpoints ``keep_last`` drops, failed."""
    moved = f" and the {link!r} link points at it" if link else ""
    what = f"older checkpoints (keep_last={keep_last})" if keep_last is not None else "the copy it replaced"
    return CheckpointError(
        f"the checkpoint {target} was committed{moved}, but removing {what} failed ({type(err).__name__}: {err}); "
        "the next save tries again"
    )
