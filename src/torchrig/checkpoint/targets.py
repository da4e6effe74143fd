"""What a save may write over: nothing, or a torchrig checkpoint; never a user's folder, file, link
or FIFO, and never a name the file system cannot hold."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from torchrig.arguments import file_in_the_way
from torchrig.checkpoint.errors import CheckpointError
from torchrig.checkpoint.meta import META
from torchrig.checkpoint.reading import read_meta_quiet

NAME_MAX = 255  # bytes in one file name: Linux's file systems, macOS and NTFS alike


def _what_is_at(path: Path, mode: int) -> str:
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)!r})"
    if stat.S_ISDIR(mode):
        return f"a directory that is not a torchrig checkpoint (it has no valid {META})"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    return "a device or socket"


def check_target(target: Path, link: str | None = None) -> None:
    """Refuse to save at ``target`` unless nothing is there or a torchrig checkpoint is (and,
    with ``link``, unless that name beside it is missing or a symlink).

    A checkpoint is a real directory (not a link) holding a valid ``meta.json``; anything else
    (a folder of results, the current directory, a link, a file, a FIFO) is the user's and is
    never replaced: a :class:`CheckpointError` names the path and what is there.
    """
    fix = (
        "; only a missing path or a torchrig checkpoint (a directory holding its meta.json, not a link) is "
        "replaced: give a new path such as 'checkpoints/step-000100', or remove what is there yourself"
    )
    if target.name == "":
        raise CheckpointError(f"cannot save a checkpoint at {target}: it is the root of the file system{fix}")
    if target.name == "..":
        raise CheckpointError(f"cannot save a checkpoint at {target}: it is the directory {target.resolve()}{fix}")
    for name in (target.name, link or ""):
        if len(os.fsencode(name)) > NAME_MAX:
            shown = target if name == target.name else target.parent / name
            raise CheckpointError(
                f"cannot save a checkpoint at {shown}: its name is {len(os.fsencode(name))} bytes long, and the file "
                f"system allows {NAME_MAX}; give a shorter name"
            )
    if link:
        check_link(target.parent / link)
    try:
        mode = target.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a file where a folder above should be
        blocking = file_in_the_way(target.parent)
        if blocking is not None:
            what = _what_is_at(blocking, blocking.lstat().st_mode)
            raise CheckpointError(
                f"cannot save a checkpoint at {target}: {blocking} is {what}, not a directory; "
                "give a path inside a directory"
            ) from None
        return
    if stat.S_ISDIR(mode) and read_meta_quiet(target) is not None:
        return
    raise CheckpointError(f"cannot save a checkpoint at {target}: it is {_what_is_at(target, mode)}{fix}")


def check_link(link: Path) -> None:
    if os.path.lexists(link) and not link.is_symlink():
        raise CheckpointError(
            f"cannot update the {link.name!r} link: {link} exists and is not a symlink; remove it or pass link=None"
        )
