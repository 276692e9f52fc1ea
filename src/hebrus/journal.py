"""A session's journal: each chunk's token ids, on the disk before the chunk is published.

The file starts with MAGIC and the model's fingerprint (64 hex digits); then one record per
chunk: its first position, its length, how many of its tokens were kept and whether it ran as
a prefix transaction (little-endian u64, u32, u32, u8; a prefix transaction may keep fewer than
its length, and its values are not the plain chunk's bits in fast mode), the ids (u32 each) and
a CRC-32 of all of that. A record is appended and flushed to the disk after the chunk's checks pass and
before its flip, so every chunk whose call returned is in the journal; a crash can leave one
more whole record (a chunk that was never acknowledged) or a torn last record, which replay
drops. A write that fails cuts the file back to its last whole record and aborts the chunk. The
header is written atomically (beside the file, then renamed); a file that holds only part of it
(a creation cut short by an older version, or an empty file) holds no chunk and is begun anew.

`replay` feeds the records past a session's frontier to it, in their own chunks (a prefix
transaction's as the same prefix transaction, so fast mode reaches the same bits too): with the snapshot
it started from, the session reaches the digest of every chunk it ever committed.
"""
from __future__ import annotations

import fcntl
import os
import struct
import zlib
from pathlib import Path

import torch

from hebrus.errors import CommandError, InvalidInput

MAGIC = b"HEBRUS-JOURNAL-2\n"
HEAD = struct.Struct("<QIIB")        # start, count, kept, prefix
CRC = struct.Struct("<I")


class Journal:
    def __init__(self, path, fingerprint: str):
        """Open `path` for appending: a new journal, or one of this model whose torn tail (if
        any) is cut off first."""
        self.path = Path(path)
        if self.path.is_dir():
            raise InvalidInput(f"{self.path} is a directory; a journal is a file")
        if not self.path.parent.is_dir():
            raise InvalidInput(f"cannot journal into {self.path}: {self.path.parent} is not a directory")
        header = MAGIC + fingerprint.encode()
        records, end = read(self.path, fingerprint) if self.path.exists() else ([], 0)
        if end < len(header):                       # no journal yet, or a creation cut short
            _create(self.path, header)
            end = len(header)
        self.end = end
        self.frontier = records[-1][0] + records[-1][2] if records else 0
        self.file = open(self.path, "r+b")
        try:                                        # one writer: a second session would interleave
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.close()
            raise InvalidInput(f"{self.path} is journaled by another session") from None
        self.file.truncate(self.end)

    def append(self, start: int, ids: torch.Tensor, kept: int | None = None, prefix: bool = False) -> None:
        """One chunk's record (`kept`: how many of its tokens it publishes, default all; `prefix`:
        it runs as a prefix transaction), on the
        disk when this returns; CommandError (the chunk aborts) when it cannot be written, the
        file cut back to its last whole record."""
        values = ids.detach().to("cpu", torch.int64).tolist()
        kept = len(values) if kept is None else kept
        body = HEAD.pack(start, len(values), kept, prefix) + struct.pack(f"<{len(values)}I", *values)
        try:
            self.file.seek(self.end)
            self.file.write(body + CRC.pack(zlib.crc32(body)))
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as exc:
            try:
                self.file.truncate(self.end)
            except OSError:
                pass
            raise CommandError("journal", f"the chunk's record could not be written to {self.path}: {exc}") from exc
        self.end += len(body) + CRC.size
        self.frontier = start + kept

    def close(self) -> None:
        self.file.close()


def read(path, fingerprint: str) -> tuple[list[tuple[int, list[int], int, bool]], int]:
    """(the whole records (start, ids, kept, prefix) in order, the byte offset after the last one). A torn
    last record is dropped; a damaged record with whole records after it, another model's
    journal or records that do not follow one another are InvalidInput."""
    data = Path(path).read_bytes()
    header = MAGIC + fingerprint.encode()
    if len(data) < len(header) and header.startswith(data):
        return [], 0                                # a creation cut short (or an empty file): no chunk
    if not data.startswith(MAGIC):
        raise InvalidInput(f"{path} is not a hebrus journal")
    if not data.startswith(header):
        raise InvalidInput(f"{path} is the journal of another model (its fingerprint differs)")
    records, at = [], len(header)
    while at < len(data):
        whole = _record(data, at)
        if whole is None:
            if _any_whole_after(data, at):
                raise InvalidInput(f"{path}: the record at byte {at} is damaged and whole records follow it")
            break                                   # a torn tail: a chunk never acknowledged
        (start, ids, kept, prefix), size = whole
        if records and start != records[-1][0] + records[-1][2]:
            raise InvalidInput(f"{path}: the record at byte {at} starts at {start}, not where the last one ended")
        records.append((start, ids, kept, prefix))
        at += size
    return records, at


def replay(session, records: list[tuple[int, list[int], int, bool]]) -> None:
    """Feed `session` the records from its frontier on, each as the chunk it was."""
    for start, ids, kept, prefix in records:
        if start + kept <= session.frontier:
            continue                                # already in the snapshot
        if start != session.frontier:
            raise InvalidInput(f"the journal does not continue this session: a chunk starts at {start}, "
                               f"the session is at {session.frontier}")
        if prefix:
            session.feed_prefix(ids, lambda logits: kept)
        else:
            session.feed(ids)


def _create(path: Path, header: bytes) -> None:
    """A new journal holding only its header, whole or not at all: written beside it, flushed,
    renamed over `path`, and the folder flushed."""
    fresh = path.with_name(path.name + ".new")
    with open(fresh, "wb") as f:
        f.write(header)
        f.flush()
        os.fsync(f.fileno())
    os.replace(fresh, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _record(data: bytes, at: int):
    if at + HEAD.size > len(data):
        return None
    start, count, kept, prefix = HEAD.unpack_from(data, at)
    end = at + HEAD.size + 4 * count
    if not 0 < kept <= count or prefix > 1 or kept < count and not prefix or end + CRC.size > len(data):
        return None
    if zlib.crc32(data[at:end]) != CRC.unpack_from(data, end)[0]:
        return None
    ids = list(struct.unpack_from(f"<{count}I", data, at + HEAD.size))
    return (start, ids, kept, bool(prefix)), end + CRC.size - at


def _any_whole_after(data: bytes, at: int) -> bool:
    """Whether a whole record starts anywhere past `at` (damage in the middle, not a torn end)."""
    return any(_record(data, i) is not None for i in range(at + 1, len(data) - HEAD.size - CRC.size + 1))
