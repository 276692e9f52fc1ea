"""Replace a folder's contents in one step: build the new folder beside it, then swap it in.

A reader of the folder sees the old contents, then (between two renames) no folder, then the new
contents; never a mix. Regular files and symlinks of the old folder that the caller does not
`drop` are carried into the new one (hard links; copies where links fail). A failure before the
swap leaves the folder as it was and removes the new one.
"""
from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Callable

from hebrus.errors import InvalidInput


def replace_folder(target: Path, write: Callable[[Path], None], drop: set[str]) -> None:
    """Make `target` a folder holding what `write(folder)` writes plus the old folder's other files."""
    carried = _carried(target, drop)
    _make_parent(target.parent)
    fresh = _new_folder(target, "new")
    try:
        if os.path.lexists(target):
            os.chmod(fresh, stat.S_IMODE(os.stat(target).st_mode))
        write(fresh)
        for source in carried:
            _carry(source, fresh / source.name)
        fsync(fresh)
        _swap(fresh, target)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    fsync(target.parent)


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _carried(target: Path, drop: set[str]) -> list[Path]:
    """The old folder's entries to carry over; InvalidInput, before anything changes, if the
    target is not a folder of plain files."""
    if not os.path.lexists(target):
        return []
    if not target.is_dir():
        raise InvalidInput(f"{target} exists and is not a directory; save writes a checkpoint directory")
    carried = []
    for entry in os.scandir(target):
        if entry.is_dir(follow_symlinks=False):
            raise InvalidInput(f"{target} holds the subdirectory {entry.name!r}; save replaces the whole "
                               f"folder, so it only saves over a folder of plain files")
        if not (entry.is_file(follow_symlinks=False) or entry.is_symlink()):
            raise InvalidInput(f"{target} holds {entry.name!r}, which is neither a regular file nor a "
                               f"symlink; save only saves over a folder of plain files")
        if entry.name not in drop:
            carried.append(Path(entry.path))
    return carried


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


def _carry(source: Path, destination: Path) -> None:
    try:
        os.link(source, destination, follow_symlinks=False)
    except OSError:
        if source.is_symlink():
            os.symlink(os.readlink(source), destination)
        else:
            shutil.copy2(source, destination)
            fsync(destination)


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
