"""Tables served in pages: rows kept in host memory and brought to the device a page at a time,
through a bounded pool of page frames (per-layer-embedding tables larger than the device).

A `PagedTable` holds a [rows, width] table on the host and a pool of page frames on the device.
Its public cache is a mapping page -> frame that only a publication changes:

- a chunk's lookups (`gather`) read the pages the mapping holds (hits) and copy each missing
  page into a free frame, one that no mapping and no chunk in flight refers to; rows of pages
  that find no free frame are copied straight from the host for that chunk alone, so a cache
  smaller than one chunk's need still serves it;
- the chunk's transaction holds its `PageClaim`: publication merges the pages it brought in
  into the mapping and evicts the least recently used beyond the mapping's capacity; an abort
  gives its frames back. The mapping never points at a half-written frame, and an aborted chunk
  leaves it as it was;
- the frames a chunk reads stay pinned until it finishes, so a publication of another session
  that evicts one never hands it out while it is still being read.

The mapping keeps a quarter of the pool (at least one frame, when there are two or more) free for
the pages a chunk brings in.
"""
from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hebrus.errors import PageReadError

DEFAULT_PAGE_ROWS = 256


class HostRows:
    """A table's rows in host memory (pinned when pages go to a GPU)."""

    def __init__(self, tensor: torch.Tensor, pin: bool = False):
        self.tensor = tensor.pin_memory() if pin and not tensor.is_pinned() else tensor
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def read(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop]

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tensor.index_select(0, ids)

    def with_dtype(self, dtype: torch.dtype) -> "HostRows":
        return HostRows(self.tensor.to(dtype), pin=self.tensor.is_pinned())

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class FileRows:
    """A table's rows where a checkpoint file holds them (`begin` is the tensor's first byte),
    read a page at a time with positioned reads: the table never sits in memory whole. Rows
    are converted to `dtype` as they arrive. A failed or short read raises `PageReadError`."""

    def __init__(self, path: Path, begin: int, shape: tuple[int, int], stored: torch.dtype, dtype: torch.dtype,
                 via: tuple[torch.dtype, ...] = ()):
        self.path, self.begin, self.shape, self.stored, self.dtype = Path(path), begin, tuple(shape), stored, dtype
        self.via = via                  # dtypes the rows passed through before `dtype` (`with_dtype`)
        self.row_bytes = shape[1] * stored.itemsize
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def read(self, start: int, stop: int) -> torch.Tensor:
        want = (stop - start) * self.row_bytes
        try:
            data = os.pread(self._fd, want, self.begin + start * self.row_bytes)
        except OSError as exc:
            raise PageReadError(f"{self.path}: rows {start}..{stop - 1} cannot be read ({exc})") from None
        if len(data) != want:
            raise PageReadError(f"{self.path}: rows {start}..{stop - 1} are cut short: the file is truncated")
        rows = torch.frombuffer(bytearray(data), dtype=self.stored).view(stop - start, self.shape[1])
        for dtype in (*self.via, self.dtype):       # the conversions a resident table went through
            rows = rows.to(dtype)
        if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
            # what a resident load refuses (NaN, infinite, or too large for the dtype) fails the read
            raise PageReadError(f"{self.path}: rows {start}..{stop - 1} hold NaN or infinite values in "
                                f"{str(self.dtype).removeprefix('torch.')}; weights must be finite")
        return rows

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any order, repeats allowed): one read per run of consecutive rows."""
        wanted = ids.tolist()
        if not wanted:
            return torch.empty((0, self.shape[1]), dtype=self.dtype)
        rows: dict[int, torch.Tensor] = {}
        unique = sorted(set(wanted))
        begin = 0
        for k in range(1, len(unique) + 1):
            if k == len(unique) or unique[k] != unique[k - 1] + 1:
                block = self.read(unique[begin], unique[k - 1] + 1)
                rows.update({row: block[row - unique[begin]] for row in unique[begin:k]})
                begin = k
        return torch.stack([rows[row] for row in wanted])

    def with_dtype(self, dtype: torch.dtype) -> "FileRows":
        return FileRows(self.path, self.begin, self.shape, self.stored, dtype, (*self.via, self.dtype))

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


class PagedTable:
    def __init__(self, source, frames: int, device: torch.device, page_rows: int = DEFAULT_PAGE_ROWS):
        if isinstance(source, torch.Tensor):
            source = HostRows(source, pin=device.type == "cuda")
        if len(source.shape) != 2:
            raise ValueError("a paged table is two-dimensional: [rows, width]")
        self.source = source
        self.rows, self.width = source.shape
        self.page_rows, self.device, self.dtype = page_rows, device, source.dtype
        self.pool = torch.zeros((frames, page_rows, self.width), dtype=self.dtype, device=device)
        self.capacity = frames - max(1, frames // 4) if frames >= 2 else 0      # pages the mapping keeps
        self.mapping: dict[int, int] = {}           # public: page -> frame, least recently used first
        self.free = list(range(frames))[::-1]
        self.pins: Counter[int] = Counter()
        self.retired: set[int] = set()              # evicted while pinned: freed when unpinned
        self.lock = threading.Lock()
        self.hits = self.misses = self.direct = 0    # pages, over the table's life

    @staticmethod
    def frames_to_hold(pages: int) -> int:
        """The fewest pool frames whose mapping keeps `pages` pages (see `capacity`)."""
        frames = max(2, pages + 1)
        while frames - max(1, frames // 4) < pages:
            frames += 1
        return frames

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.width)

    @property
    def device_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def host_bytes(self) -> int:
        """The table's bytes outside the device (in host memory, or in its file)."""
        return self.source.nbytes

    def claim(self) -> "PageClaim":
        """A chunk's use of the table (`layers.ple.RowTable`), for its transaction to hold."""
        return PageClaim(self)

    def gather(self, index: torch.Tensor, claim: "PageClaim") -> torch.Tensor:
        """Rows `index` (any shape, ids in range) -> [*index.shape, width] on the device."""
        ids = index.reshape(-1).tolist()            # which pages: a host decision
        P = self.page_rows
        loads = []
        with self.lock:                             # the bookkeeping; the reads come after, unlocked
            for page in sorted({i // P for i in ids}):
                if page in claim.frames or page in claim.direct:
                    continue
                frame = self.mapping.get(page)
                if frame is not None:
                    self.hits += 1
                    claim.read[page] = frame
                elif self.free:
                    frame = self.free.pop()          # this claim's alone until it finishes
                    self.misses += 1
                    claim.admitted[page] = frame
                    loads.append((page, frame))
                else:
                    self.direct += 1
                    claim.direct.add(page)
                    continue
                claim.frames[page] = frame
                self.pins[frame] += 1
        for k, (page, frame) in enumerate(loads):
            try:
                rows = self.source.read(page * P, min(self.rows, (page + 1) * P))
            except BaseException:                   # the pages not read leave the claim: it holds only whole pages
                with self.lock:
                    for page, frame in loads[k:]:
                        del claim.admitted[page], claim.frames[page]
                        self.retired.add(frame)
                        self._unpin(frame)
                raise
            self.pool[frame, :len(rows)].copy_(rows, non_blocking=True)
        where = torch.tensor([claim.frames[i // P] * P + i % P if i // P in claim.frames else -1 for i in ids],
                             dtype=torch.int64)
        cached = where >= 0
        if bool(cached.all()):
            out = self.pool.view(-1, self.width).index_select(0, where.to(self.device))
        else:                                       # some rows straight from the host
            out = torch.empty((len(ids), self.width), dtype=self.dtype, device=self.device)
            direct = ~cached
            out[direct.to(self.device)] = self.source.take(torch.tensor(ids, dtype=torch.int64)[direct]).to(self.device)
            if bool(cached.any()):
                out[cached.to(self.device)] = self.pool.view(-1, self.width).index_select(
                    0, where[cached].to(self.device))
        return out.view(*index.shape, self.width)

    def _unpin(self, frame: int) -> None:
        self.pins[frame] -= 1
        if self.pins[frame] <= 0:
            del self.pins[frame]
            if frame in self.retired:
                self.retired.discard(frame)
                self.free.append(frame)

    def commit(self, claim: "PageClaim") -> None:
        """Publication: the claim's pages join the mapping (most recent last), the least recently
        used beyond capacity are evicted, its pins are released."""
        with self.lock:
            mapping = dict(self.mapping)
            for page, frame in claim.read.items():
                if mapping.get(page) == frame:       # still mapped: now the most recent
                    mapping[page] = mapping.pop(page)
            for page, frame in claim.admitted.items():
                if page in mapping or self.capacity == 0:     # another chunk published it first
                    self.retired.add(frame)
                else:
                    mapping[page] = frame
            while len(mapping) > self.capacity:
                page = next(iter(mapping))
                frame = mapping.pop(page)
                if self.pins[frame] > 0:
                    self.retired.add(frame)
                else:
                    self.free.append(frame)
            self.mapping = mapping                  # the cache's publication point
            for frame in claim.frames.values():
                self._unpin(frame)
            claim.frames.clear()

    def release(self, claim: "PageClaim") -> None:
        """Abort: the pages the claim brought in are dropped (their frames free again), its pins
        released; the mapping is as it was."""
        with self.lock:
            for frame in claim.admitted.values():
                self.retired.add(frame)
            for frame in claim.frames.values():
                self._unpin(frame)
            claim.frames.clear()


@dataclass
class PageClaim:
    """One chunk's use of a paged table, held by its transaction until it finishes."""
    table: PagedTable
    frames: dict[int, int] = field(default_factory=dict)     # page -> frame this chunk reads
    read: dict[int, int] = field(default_factory=dict)       # of those, the mapped ones (hits)
    admitted: dict[int, int] = field(default_factory=dict)   # and the ones it brought in
    direct: set[int] = field(default_factory=set)            # pages it read straight from the host

    finished: bool = False

    def commit(self) -> None:
        if not self.finished:                   # a claim is finished once, whichever way
            self.finished = True
            self.table.commit(self)

    def release(self) -> None:
        if not self.finished:
            self.finished = True
            self.table.release(self)

