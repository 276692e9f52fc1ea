"""Replace a folder's contents in one step: build the new folder beside it, then swap it in.

A reader of the folder sees the old contents, then (between two renames) no folder, then the new
contents; never a mix. The new folder holds what the caller writes and nothing of the old one.
A failure before the swap leaves the folder as it was and removes the new one.
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Callable

from hebrus.errors import InvalidInput


def replace_folder(target: Path, write: Callable[[Path], None], overwrite: bool = True) -> None:
    """Make `target` a folder holding exactly what `write(folder)` writes. A `target` that exists
    must be a folder of plain files (`check_replaceable`); unless `overwrite`, an empty one, and
    the new folder then takes its place by one rename that fails (InvalidInput, nothing
    replaced) if something was put there meanwhile."""
    check_replaceable(target)
    _make_parent(target.parent)
    fresh = _new_folder(target, "new")
    try:
        if os.path.lexists(target):
            os.chmod(fresh, stat.S_IMODE(os.stat(target).st_mode))
        write(fresh)
        fsync(fresh)
        if overwrite:
            _swap(fresh, target)
        else:
            _place(fresh, target)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    fsync(target.parent)


def _place(fresh: Path, target: Path) -> None:
    """Rename `fresh` to `target`, which must be absent or an empty folder (a rename replaces
    only that); a file or anything put in the folder meanwhile refuses it."""
    try:
        os.rename(fresh, target)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise InvalidInput(f"{target} was filled while the model was being written; nothing was replaced (name "
                           f"a new folder, or replace it with overwrite=True)") from None


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(target: Path) -> list[str]:
    """The names in `target` (none when it does not exist); InvalidInput, before anything
    changes, if it is not a folder of plain files (a folder holding folders is never replaced)."""
    if not os.path.lexists(target):
        return []
    if not target.is_dir():
        raise InvalidInput(f"{target} exists and is not a directory; save writes a checkpoint directory")
    names = []
    for entry in os.scandir(target):
        if entry.is_dir(follow_symlinks=False):
            raise InvalidInput(f"{target} holds the subdirectory {entry.name!r}; save replaces the whole "
                               f"folder, so it only saves over a folder of plain files")
        if not (entry.is_file(follow_symlinks=False) or entry.is_symlink()):
            raise InvalidInput(f"{target} holds {entry.name!r}, which is neither a regular file nor a "
                               f"symlink; save only saves over a folder of plain files")
        names.append(entry.name)
    return sorted(names)


def _make_parent(parent: Path) -> None:
    if os.path.lexists(parent) and not parent.is_dir():
        raise InvalidInput(f"{parent} is not a directory, so nothing can be saved inside it")
    parent.mkdir(parents=True, exist_ok=True)


def _new_folder(target: Path, role: str) -> Path:
    """An empty folder next to `target` (same filesystem, so renames are atomic)."""
    while True:
        folder = target.parent / f".{target.name[:80]}.{role}-{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def _swap(fresh: Path, target: Path) -> None:
    """Rename `fresh` to `target`; an existing target is renamed away first and then deleted."""
    if not os.path.lexists(target):
        os.rename(fresh, target)
        return
    old = _new_folder(target, "old")
    try:
        os.rename(target, old)                  # replaces the empty placeholder
    except BaseException:
        old.rmdir()
        raise
    try:
        os.rename(fresh, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
