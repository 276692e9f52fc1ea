"""Reading the files of an untrusted checkpoint folder.

A file is read only if it is a regular file (a symlink to one is fine): a FIFO, device or
directory is refused before it is opened, so a load never blocks on one. JSON files are read up
to `MAX_JSON_BYTES`, must be UTF-8 and may not repeat a key. Shard names from an index are
plain file names, so they can only name files inside the folder.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from hebrus.errors import CheckpointError, InvalidInput
from hebrus.show import shown

MAX_JSON_BYTES = 64 * 2**20          # an index of a very large model is a few MiB; config.json is 1 KiB

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def folder_path(value, what: str) -> Path:
    """A caller's str or path-like as a Path: not bytes, not empty, no NUL (InvalidInput)."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidInput(f"{what} must be a str or a path, got {type(value).__name__}")
    try:
        text = os.fspath(value)
    except Exception as exc:
        raise InvalidInput(f"{what}: os.fspath failed ({type(exc).__name__}: {exc})") from None
    if not isinstance(text, str):
        raise InvalidInput(f"{what} must be a str path, got {type(text).__name__}")
    if not text or "\0" in text:
        raise InvalidInput(f"{what} must be a non-empty path without NUL characters, got {shown(text)}")
    return Path(text)


def regular_file(path: Path) -> Path:
    """`path`, if it is (or links to) a regular file; CheckpointError otherwise. Opens nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
        raise CheckpointError(f"{path}: is {kind}, not a regular file; checkpoint files must be regular "
                              f"files or symlinks to one")
    return path


def read_json(path: Path) -> Any:
    """The parsed JSON of a regular file of at most MAX_JSON_BYTES."""
    data = _read_bytes(regular_file(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: is not valid JSON ({exc})") from None


def read_text(path: Path) -> str:
    """The UTF-8 text of a regular file of at most MAX_JSON_BYTES."""
    data = _read_bytes(regular_file(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def is_shard_name(name: Any) -> bool:
    """A plain file name: no directory part, not '.' or '..', nothing the OS would refuse."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and len(name.encode("utf-8", "replace")) <= 255 and not any(c in name for c in "/\\\x00"))


def _read_bytes(path: Path) -> bytes:
    try:
        data = _read_regular(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: is larger than {MAX_JSON_BYTES} bytes, the most a JSON file may hold")
    return data


def _read_regular(path: Path) -> bytes:
    # Non-blocking, in case the file was swapped for a FIFO after it was checked.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: is not a regular file")
        return file.read(MAX_JSON_BYTES + 1)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"the key {shown(key)} appears twice")
        data[key] = value
    return data
