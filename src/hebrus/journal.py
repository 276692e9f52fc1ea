"""A session's journal: each chunk's token ids, on the disk before the chunk is published.

The file starts with its format's magic line and the model's fingerprint (64 hex digits); then
one record per chunk. Format 3 (written now): a record word, the chunk's first position, its
length, how many of its tokens were kept and whether it ran as a prefix transaction
(little-endian u64, u32, u32, u8; a prefix transaction may keep fewer than its length, and its
values are not the plain chunk's bits in fast mode), a CRC-32 of that head, the ids (u32 each)
and a CRC-32 of the whole record. Format 2 (written before) has no record word and no head CRC;
it is still read, and a journal of format 2 that journals on is first rewritten as format 3.

A record is written and flushed to the disk after the chunk's checks pass and before its flip,
so every chunk whose call returned is in the journal. Writes are unbuffered: a record reaches
the file only while its own chunk writes it. One that fails is cut back off the file (or, where
the file cannot be cut, its record word is overwritten, which leaves no record), and the chunk
aborts; a journal that cannot do either is broken and refuses every later chunk. A crash can
leave one more whole record (a chunk that was never acknowledged) or a torn last record, which
replay drops. The header is written atomically (beside the file, then renamed); a file that
holds only part of it (a creation cut short, or an empty file) holds no chunk and is begun anew.

Reading is linear in the file: a record's length is bounded by the model's context limit, a
claimed length past the file's end is never checksummed, and a crash tears at most the last
record, so more bytes after the last whole record than one record can hold are damage, refused
at once; within one record's length, a format 3 record is found by its word and head CRC.

`replay` feeds the records past a session's frontier to it, in their own chunks (a prefix
transaction's as the same prefix transaction, so fast mode reaches the same bits too): with the
snapshot it started from, the session reaches the digest of every chunk it ever committed.
"""
from __future__ import annotations

import fcntl
import os
import secrets
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from hebrus.errors import CommandError, InvalidInput
from hebrus.show import shown

CRC = struct.Struct("<I")


class Record(NamedTuple):
    start: int
    ids: list[int]
    kept: int
    prefix: bool


def _crc(view, value: int = 0) -> int:
    """CRC-32 of `view` (every checksum of the journal goes through here)."""
    return zlib.crc32(view, value)


class _Format:
    """One record layout: its magic line, how a record is packed, and how one is found."""

    def __init__(self, magic: bytes, word: bytes, head: str):
        self.magic, self.word, self.head_struct = magic, word, struct.Struct(head)
        self.checked_head = bool(word)          # the head has a CRC of its own

    @property
    def head_size(self) -> int:
        return self.head_struct.size + (CRC.size if self.checked_head else 0)

    def head(self, start: int, count: int, kept: int, prefix: bool) -> bytes:
        fields = (self.word,) if self.word else ()
        head = self.head_struct.pack(*fields, start, count, kept, prefix)
        return head + CRC.pack(_crc(head)) if self.checked_head else head

    def record(self, start: int, ids: list[int], kept: int, prefix: bool) -> bytes:
        body = self.head(start, len(ids), kept, prefix) + struct.pack(f"<{len(ids)}I", *ids)
        return body + CRC.pack(_crc(body))

    def encode(self, fingerprint: str, records) -> bytes:
        return self.magic + fingerprint.encode() + b"".join(self.record(*r) for r in records)

    def largest(self, max_context: int) -> int:
        """The most bytes one record can take."""
        return self.head_size + 4 * max_context + CRC.size

    def parse(self, data: bytes, at: int, max_context: int) -> tuple[Record, int] | None:
        """(the whole record at `at`, its size), or None. Nothing past the file's end, and no
        length past the context limit, is ever checksummed."""
        fields = self._fields(data, at, max_context)
        if fields is None:
            return None
        start, count, kept, prefix = fields
        end = at + self.head_size + 4 * count
        if end + CRC.size > len(data) or _crc(memoryview(data)[at:end]) != CRC.unpack_from(data, end)[0]:
            return None
        ids = list(struct.unpack_from(f"<{count}I", data, at + self.head_size))
        return Record(start, ids, kept, bool(prefix)), end + CRC.size - at

    def _fields(self, data: bytes, at: int, max_context: int):
        if at + self.head_size > len(data) or self.word and not data.startswith(self.word, at):
            return None
        *word, start, count, kept, prefix = self.head_struct.unpack_from(data, at)
        if self.checked_head:
            end = at + self.head_struct.size
            if _crc(memoryview(data)[at:end]) != CRC.unpack_from(data, end)[0]:
                return None
        if not 0 < kept <= count <= max_context or prefix > 1 or kept < count and not prefix:
            return None
        return start, count, kept, prefix

    def begins_after(self, data: bytes, at: int, max_context: int) -> bool:
        """Whether a record begins anywhere past `at` (damage in the middle, not a torn end).
        Format 3: a record word whose head CRC holds. Format 2 has only whole records to go by,
        each found by its checksum: the search checksums at most twice the bytes it searches,
        and a tail that would take more is taken for damage (refused, never dropped)."""
        if not self.word:
            budget, spent = 2 * (len(data) - at) + self.largest(0), 0
            for i in range(at + 1, len(data)):
                fields = self._fields(data, i, max_context)
                if fields is None:
                    continue
                spent += self.head_size + 4 * fields[1]
                if spent > budget or self.parse(data, i, max_context) is not None:
                    return True
            return False
        found = data.find(self.word, at + 1)
        while found != -1:
            if self._fields(data, found, max_context) is not None:
                return True
            found = data.find(self.word, found + 1)
        return False


FORMAT_3 = _Format(b"HEBRUS-JOURNAL-3\n", b"\xa5HJ\x03", "<4sQIIB")
FORMAT_2 = _Format(b"HEBRUS-JOURNAL-2\n", b"", "<QIIB")
FORMATS = (FORMAT_3, FORMAT_2)
MAGIC = FORMAT_3.magic


class Journal:
    def __init__(self, path, fingerprint: str, max_context: int, empty: bool = False):
        """Open `path` for appending, locked first (one writer: a second would interleave),
        then read: a new journal, or one of this model whose torn tail (if any) is cut off; a
        format 2 journal is rewritten as format 3. `empty`: refuse, changing nothing, a journal
        that already holds chunks (a new session's)."""
        self.path = _journal_path(path)
        if not self.path.parent.is_dir():
            raise InvalidInput(f"cannot journal into {self.path}: {self.path.parent} is not a directory")
        self.max_context, self.broken = max_context, None       # broken: why no chunk can be journaled
        if not self.path.exists():
            _create(self.path, FORMAT_3.encode(fingerprint, []), replace=False)
        self.file = _locked(self.path)
        try:
            self._open(fingerprint, empty)
        except BaseException:
            self.file.close()
            raise

    def _open(self, fingerprint: str, empty: bool) -> None:
        records, end, form = parse(self.path, _read_all(self.file), fingerprint, self.max_context)
        self.frontier = records[-1].start + records[-1].kept if records else 0
        if empty and records:
            raise InvalidInput(f"{self.path} already holds chunks; continue it with "
                               f"model.recover({str(self.path)!r}, snapshot=...) or journal into a new file")
        if end == 0 or form is not FORMAT_3:        # a creation cut short, or format 2: begun anew
            _create(self.path, FORMAT_3.encode(fingerprint, records))
            self.file.close()
            self.file = _locked(self.path)
            end = os.fstat(self.file.fileno()).st_size
        self.end = end
        os.ftruncate(self.file.fileno(), self.end)

    def append(self, start: int, ids: torch.Tensor, kept: int | None = None, prefix: bool = False) -> None:
        """One chunk's record (`kept`: how many of its tokens it publishes, default all; `prefix`:
        it runs as a prefix transaction), on the disk when this returns; CommandError (the chunk
        aborts) when it cannot be written, with nothing of it left as a record in the file (any
        other exception, Ctrl-C's too, cuts it back as well)."""
        if self.broken is not None:
            raise CommandError("journal", f"the journal {self.path} is broken ({self.broken}), so no chunk can be "
                                          f"journaled; save the session (s.save) and journal into a new file")
        values = ids.detach().to("cpu", torch.int64).tolist()
        record = FORMAT_3.record(start, values, len(values) if kept is None else kept, prefix)
        fd = self.file.fileno()
        try:
            _write(fd, record, self.end)
            os.fsync(fd)
        except BaseException as exc:
            self._cut_back()
            if isinstance(exc, OSError):
                raise CommandError("journal", f"the chunk's record could not be written to {self.path}: "
                                              f"{exc}") from exc
            raise
        self.end += len(record)
        self.frontier = start + (len(values) if kept is None else kept)

    def _cut_back(self) -> None:
        """Leave no record past the last whole one: cut the file there, or else overwrite the
        failed record's word in place (what is left is a torn tail, dropped at recovery). If
        neither can be done, the journal is broken. A flush that fails here leaves it to the next
        record's flush, which carries the cut with it."""
        fd = self.file.fileno()
        try:
            os.ftruncate(fd, self.end)
        except OSError:
            try:
                _write(fd, bytes(len(FORMAT_3.word)), self.end)
            except OSError as exc:
                self.broken = f"a record that failed could not be cut back: {exc}"
                return
        try:
            os.fsync(fd)
        except OSError:
            pass

    def close(self) -> None:
        """Release the file and its lock (also done when the journal is collected)."""
        self.file.close()


def _journal_path(path) -> Path:
    """`path` as a Path naming a file (or nothing yet); InvalidInput for anything else."""
    try:
        path = Path(path)
        kind = "directory" if path.is_dir() else "other" if path.exists() and not path.is_file() else None
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"a journal is a file path, got {shown(path)} ({exc})") from None
    if kind == "directory":
        raise InvalidInput(f"{path} is a directory; a journal is a file")
    if kind == "other":
        raise InvalidInput(f"{path} is not a regular file; a journal is one")
    return path


def _locked(path: Path):
    """`path` opened for unbuffered reading and writing (closed, its lock released, when it is
    collected), exclusively locked, and still the file the path names once locked (another
    session creating it at the same moment may have renamed a new one over it); InvalidInput
    when another session holds the lock."""
    for _ in range(8):
        file = open(path, "r+b", buffering=0)
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.close()
            raise InvalidInput(f"{path} is journaled by another session") from None
        if os.path.samestat(os.fstat(file.fileno()), os.stat(path)):
            return file
        file.close()
    raise InvalidInput(f"{path} keeps being replaced while it is opened; is another program writing it?")


def _read_all(file) -> bytes:
    file.seek(0)
    return file.read()


def read(path, fingerprint: str, max_context: int) -> tuple[list[Record], int, _Format | None]:
    """`parse` of the journal file `path`."""
    path = _journal_path(path)
    if not path.exists():
        raise InvalidInput(f"{path} is not a journal (no such file)")
    return parse(path, path.read_bytes(), fingerprint, max_context)


def parse(path, data: bytes, fingerprint: str, max_context: int) -> tuple[list[Record], int, _Format | None]:
    """(the whole records in order, the byte offset after the last one, the file's format) of a
    journal's bytes. A torn last record is dropped; a damaged record with records after it, more
    bytes after the last whole record than one record holds, another model's journal or records
    that do not follow one another are InvalidInput."""
    form = next((f for f in FORMATS if data.startswith(f.magic)), None)
    if form is None:
        if any((f.magic + fingerprint.encode()).startswith(data) for f in FORMATS):
            return [], 0, None                      # a creation cut short (or an empty file): no chunk
        raise InvalidInput(f"{path} is not a hebrus journal")
    header = form.magic + fingerprint.encode()
    if not data.startswith(header):
        if header.startswith(data):
            return [], 0, None
        raise InvalidInput(f"{path} is the journal of another model (its fingerprint differs)")
    records, at = [], len(header)
    while at < len(data):
        whole = form.parse(data, at, max_context)
        if whole is None:
            _check_tail(path, form, data, at, max_context)
            break                                   # a torn tail: a chunk never acknowledged
        record, size = whole
        if records and record.start != records[-1].start + records[-1].kept:
            raise InvalidInput(f"{path}: the record at byte {at} starts at {record.start}, not where the last one "
                               f"ended")
        records.append(record)
        at += size
    return records, at, form


def _check_tail(path, form: _Format, data: bytes, at: int, max_context: int) -> None:
    """What follows the last whole record must be what a crash leaves: part of one record."""
    rest = len(data) - at
    cut = (f"the whole records end at byte {at}; to keep them and drop the rest, cut the file there "
           f"(truncate -s {at})")
    if rest > form.largest(max_context):
        raise InvalidInput(f"{path}: the record at byte {at} is damaged and {rest} bytes follow it, more than one "
                           f"record holds (a crash leaves at most one torn record): {cut}")
    if form.begins_after(data, at, max_context):
        raise InvalidInput(f"{path}: the record at byte {at} is damaged and records follow it (what follows is "
                           f"not the torn end of one record): {cut}")


def replay(session, records: list[Record]) -> None:
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


def _write(fd: int, data: bytes, at: int) -> None:
    """All of `data` at offset `at`, or OSError (a short write is continued, never left)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        if written == 0:
            raise OSError(f"nothing more could be written after {len(data) - len(view)} of {len(data)} bytes")
        view, at = view[written:], at + written


def _create(path: Path, data: bytes, replace: bool = True) -> None:
    """A new journal holding `data` (its header, and any records carried over), whole or not at
    all: written beside it, flushed, renamed over `path` (or, not `replace`, linked to `path`
    unless a file is there by then), and the folder flushed."""
    fresh = path.with_name(f".{path.name}.{secrets.token_hex(6)}.new")
    try:
        with open(fresh, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(fresh, path)
        else:
            try:
                os.link(fresh, path)            # never over a journal another session just made
            except FileExistsError:
                pass
    finally:
        fresh.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
