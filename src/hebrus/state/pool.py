"""The state pool of one model on one device: every session's state in a few shared tensors.

Each banked owner is one tensor `[2, slots, ...]`: a session is a slot, and its public bank is a
parity. Each appended owner lives in fixed-size blocks `[blocks, block_rows, ...]`: a session's
rows are a block table, row r in block `table[r // block_rows]` at `r % block_rows`. Blocks are
reference-counted, so a fork shares its parent's blocks; a step that writes into a shared block
writes a copy of it instead (copy-on-write), so a fork costs neither side a whole context.

The pool only allocates and counts: which slot and blocks a step may write, what to release
when it aborts or publishes. Publication stays the session's one assignment of an immutable
record (slot, parity, frontier, block table); nothing here is public state. Running out is
`PoolFull`, raised before anything is taken.
"""
from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from hebrus.errors import AllocationError, InvalidInput
from hebrus.state.budget import out_of_memory
from hebrus.state.owners import APPENDED, BANKED, OwnerSpec
from hebrus.uploads import upload

BLOCK_ROWS = 16         # rows a block holds, unless the pool is told otherwise
MAX_SLOTS = 1024        # slots a pool carves unless told how many
CPU_FRACTION = 0.25      # of the host's memory: a CPU pool's pages are touched only as they are used
CUDA_FRACTION = 0.3      # of the free device memory when the pool is carved


@dataclass(frozen=True)
class PoolSize:
    """How large a model's pool is: `nbytes`, or `fraction` of the device's free memory when
    it is carved (None and None: the default of its device)."""
    nbytes: int | None = None
    fraction: float | None = None

    def checked(self) -> "PoolSize":
        if self.nbytes is not None and self.fraction is not None:
            raise InvalidInput("give pool_bytes or memory_fraction, not both")
        if self.nbytes is not None and (type(self.nbytes) is not int or self.nbytes < 1):
            raise InvalidInput(f"pool_bytes must be a positive int (bytes); got {self.nbytes!r}")
        if self.fraction is not None and (type(self.fraction) not in (int, float) or not 0 < self.fraction <= 1):
            raise InvalidInput(f"memory_fraction must be a number in (0, 1]; got {self.fraction!r}")
        return self

    def resolve(self, device: torch.device) -> int:
        if self.nbytes is not None:
            return self.nbytes
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            return int(free * (self.fraction or CUDA_FRACTION))
        if self.fraction is not None:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return int(free * self.fraction)
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_FRACTION)

    def carve(self, specs: list[OwnerSpec], device: torch.device, max_rows: int) -> "Pool":
        """The pool of this size (AllocationError when not even one session fits it)."""
        nbytes = self.resolve(device)
        try:
            return Pool.carve(specs, device, nbytes, max_rows)
        except PoolFull as exc:
            raise AllocationError("session", f"the state pool: {exc}") from None
        except Exception as exc:
            if out_of_memory(exc):
                raise AllocationError("session", f"the state pool ({nbytes} bytes): {type(exc).__name__}: "
                                      f"{exc}") from None
            raise


class PoolFull(Exception):
    """No free slot, or fewer free blocks than a step needs: nothing was taken."""


@dataclass(frozen=True, slots=True)
class Rows:
    """The blocks a step writes: `table`, the session's block table after the step (a shared
    block it writes replaced by its copy, new blocks at the end); `taken`, the blocks the step
    took (released if it aborts); `copies`, (from, to) block pairs to copy before writing;
    `dropped`, the blocks of the old table the new one no longer holds (released if it
    publishes)."""
    table: tuple[int, ...]
    taken: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    dropped: tuple[int, ...]


class Pool:
    """`max_rows`: the most rows one session holds (the model's context), so the most blocks a
    table holds. Memory is allocated once, uninitialised: a slot's banks are filled when it is
    taken and a block is zeroed when it is taken, so on the host only what sessions use is ever
    touched. Every method may be called from any thread."""

    def __init__(self, specs: list[OwnerSpec], device: torch.device, slots: int, blocks: int, block_rows: int,
                 max_rows: int | None = None):
        if slots < 1 or blocks < 0 or block_rows < 1:
            raise ValueError(f"a pool needs a slot and a positive block size, got slots={slots}, "
                             f"blocks={blocks}, block_rows={block_rows}")
        self.specs, self.device = specs, device
        self.slots, self.blocks, self.block_rows = slots, blocks, block_rows
        self.max_rows = max_rows if max_rows is not None else blocks * block_rows
        # one slot and two blocks past the counted ones serve a planned step's padding lanes
        # (`engine.graphs`): the spare slot and the scratch block take what padding writes, the
        # zero block stands for every block past a table's end (always zero: nothing writes it)
        self.spare_slot, self.scratch_block, self.zero_block = slots, blocks, blocks + 1
        self.banks = {s.name: torch.empty((2, slots + 1, *s.shape), dtype=s.dtype, device=device)
                      for s in specs if s.kind == BANKED}
        self.rows = {s.name: torch.empty((blocks + 2, block_rows, *s.shape), dtype=s.dtype, device=device)
                     for s in specs if s.kind == APPENDED}
        fills = {s.name: s.fill for s in specs if s.kind == BANKED}
        for name, bank in self.banks.items():
            bank[:, slots].fill_(fills[name])
        for storage in self.rows.values():
            _bytes(storage[blocks:]).zero_()
        self._free_slots = list(range(slots - 1, -1, -1))      # popped from the end: slot 0 first
        # free blocks, popped from the end (block 0 first); a block taken out of turn (the one
        # after a table's last, so that a session's blocks run on) stays listed until popped,
        # and only an entry whose block no table holds counts as free
        self._free_blocks = list(range(blocks - 1, -1, -1))
        self._free = blocks
        self._references = np.zeros(blocks, dtype=np.int64)     # how many tables hold each block
        self._zeroed = [name for name, fill in fills.items() if fill == 0]     # reset together (`take_slot`)
        self._filled = {name: fill for name, fill in fills.items() if fill != 0}
        self.slot_nbytes, self.block_nbytes = self.slot_bytes(specs), self.block_bytes(specs, block_rows)
        self._lock = threading.RLock()
        self._zeroing = threading.local()           # .blocks: this thread's blocks to zero together

    @staticmethod
    def slot_bytes(specs: list[OwnerSpec]) -> int:
        """Bytes a slot takes: both banks of every banked owner."""
        return 2 * sum(s.nbytes for s in specs if s.kind == BANKED)

    @staticmethod
    def block_bytes(specs: list[OwnerSpec], block_rows: int) -> int:
        """Bytes a block takes: `block_rows` rows of every appended owner."""
        return block_rows * sum(s.nbytes for s in specs if s.kind == APPENDED)

    @classmethod
    def carve(cls, specs: list[OwnerSpec], device: torch.device, pool_bytes: int, max_rows: int,
              slots: int | None = None, block_rows: int = BLOCK_ROWS) -> "Pool":
        """A pool of at most `pool_bytes`: `slots` slots (default: as many as half the bytes
        hold, at least one and at most `MAX_SLOTS`) and blocks from the rest, at most as many as
        every slot's table at `max_rows` rows. `PoolFull` when not even the slots fit."""
        per_slot, per_block = cls.slot_bytes(specs), cls.block_bytes(specs, block_rows)
        pool_bytes -= per_slot + 2 * per_block          # the padding's slot and blocks
        if slots is None:
            slots = min(MAX_SLOTS, max(1, pool_bytes // 2 // max(per_slot, 1)))
        left = pool_bytes - slots * per_slot
        if left < 0:
            raise PoolFull(f"{slots} slot{'s' if slots != 1 else ''} of {per_slot} bytes do not fit a pool of "
                           f"{pool_bytes} bytes")
        blocks = min(left // per_block, slots * -(-max_rows // block_rows)) if per_block else 0
        return cls(specs, device, slots, blocks, block_rows, max_rows)

    # ---- slots ---------------------------------------------------------------------------------
    def take_slot(self) -> tuple[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """A free slot and its banks, each owner's value in bank 0 and in bank 1 (owner name ->
        a view of the pool), every value reset to its owner's fill: the owners that start at zero
        in one call (one launch on a GPU for all of them, where a fill each was 39 for the 1.68B
        Qwen3.5 shape), the others one by one."""
        with self._lock:
            if not self._free_slots:
                raise PoolFull(f"all {self.slots} slots of the state pool hold sessions")
            slot = self._free_slots.pop()
        views = tuple({name: bank[parity, slot] for name, bank in self.banks.items()} for parity in (0, 1))
        if self._zeroed:
            torch._foreach_zero_([bank[name] for bank in views for name in self._zeroed])
        for name, fill in self._filled.items():
            for bank in views:
                bank[name].fill_(fill)
        return slot, views

    def copy_slot(self, source: int, parity: int, target: int) -> None:
        """Bank `parity` of slot `source` into the same bank of slot `target` (a fork's)."""
        for bank in self.banks.values():
            bank[parity, target] = bank[parity, source]

    def free_slot(self, slot: int) -> None:
        with self._lock:
            if slot in self._free_slots or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not held")
            self._free_slots.append(slot)

    # ---- blocks --------------------------------------------------------------------------------
    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_rows)

    def share(self, table: tuple[int, ...]) -> tuple[int, ...]:
        """The same blocks held once more (a fork's table)."""
        with self._lock:
            self._references[np.fromiter(table, dtype=np.int64, count=len(table))] += 1   # blocks in a table are distinct
        return table

    def release(self, blocks) -> None:
        """Hold each block once less; a block no one holds is free."""
        if not blocks:
            return
        blocks = np.fromiter(blocks, dtype=np.int64)
        with self._lock:
            held = self._references[blocks]
            if (held <= 0).any():
                raise ValueError(f"block {int(blocks[held <= 0][0])} is not held")
            self._references[blocks] = held - 1
            freed = blocks[held == 1].tolist()
            self._free_blocks += freed
            self._free += len(freed)
        waiting = getattr(self._zeroing, "blocks", None)
        if waiting and freed:                       # free again: whoever takes them next zeroes them
            gone = set(freed)
            self._zeroing.blocks = [b for b in waiting if b not in gone]

    def writable(self, table: tuple[int, ...], frontier: int, rows: int) -> Rows:
        """What a step that writes rows [frontier, frontier + rows) needs: the blocks past the
        table's end, and a copy of every shared block it writes into. Takes them, or raises
        `PoolFull` having taken nothing."""
        first, end = frontier // self.block_rows, self.blocks_for(frontier + rows)
        with self._lock:
            shared = [i for i in range(first, min(end, len(table))) if rows and self._references[table[i]] > 1]
            wanted = len(shared) + max(0, end - len(table))
            if wanted > self._free:
                raise PoolFull(f"{rows} rows at row {frontier} need {wanted} more blocks of "
                               f"{self.block_rows} rows; {self._free} of the state pool's "
                               f"{self.blocks} are free")
            taken = [self._take_block() for _ in shared]
            taken += self._take_run(table, wanted - len(shared))
        new, copies = list(table), []
        for i, block in zip(shared, taken):
            new[i] = block
            copies.append((table[i], block))
        new += taken[len(shared):]
        self._zero(taken[len(shared):])
        return Rows(tuple(new), tuple(taken), tuple(copies), tuple(table[i] for i in shared))

    def extend(self, table: tuple[int, ...], rows: int) -> tuple[int, ...]:
        """Free blocks taken to make `table` hold `rows` rows (at most `max_rows`), as many as
        are free: the blocks taken (zeroed), to be appended to the table."""
        wanted = self.blocks_for(min(rows, self.max_rows)) - len(table)
        with self._lock:
            taken = self._take_run(table, min(max(wanted, 0), self._free))
        self._zero(taken)
        return tuple(taken)

    def _take_run(self, table: tuple[int, ...], count: int) -> list[int]:
        """`count` blocks to append to `table`, each the one after the last where it is free (a
        table of consecutive blocks is read as a view of the storage)."""
        taken: list[int] = []
        for _ in range(count):
            last = taken[-1] if taken else table[-1] if table else None
            taken.append(self._take_block(last))
        return taken

    def _take_block(self, after: int | None = None) -> int:
        block = after + 1 if after is not None and after + 1 < self.blocks else None
        if block is None or self._references[block]:
            block = self._free_blocks.pop()
            while self._references[block]:             # taken out of turn since it was listed
                block = self._free_blocks.pop()
        self._references[block] = 1
        self._free -= 1
        return block

    @contextmanager
    def zeroing_together(self):
        """Blocks this thread takes inside the block are zeroed together when it ends: one fill
        of each row storage for all of them (a step whose sessions all grow takes blocks for each:
        zeroed one session at a time, that was a fill per storage per session, hundreds of
        launches in one step). A block given back before the end is not zeroed then (whoever
        takes it next zeroes it). Nested, the outermost block zeroes."""
        if getattr(self._zeroing, "blocks", None) is not None:
            yield
            return
        self._zeroing.blocks = []
        try:
            yield
        finally:
            blocks, self._zeroing.blocks = self._zeroing.blocks, None
            self._zero(blocks)

    def _zero(self, blocks) -> None:
        """Rows past a frontier read as zeros (a planned step reads them, masked); inside
        `zeroing_together`, once it ends."""
        waiting = getattr(self._zeroing, "blocks", None)
        if waiting is not None:
            waiting += blocks
            return
        if blocks:
            index = upload(blocks, torch.long, self.device)
            for storage in self.rows.values():
                _bytes(storage).index_fill_(0, index, 0)

    def exclusive(self, table: tuple[int, ...], start: int, stop: int) -> bool:
        """Whether `table` holds rows [start, stop) in blocks no other table holds."""
        end = self.blocks_for(stop)
        if end > len(table):
            return False
        references = self._references
        with self._lock:
            for i in range(start // self.block_rows, end):
                if references[table[i]] != 1:
                    return False
        return True

    def log(self, name: str, table: torch.Tensor, host: tuple[int, ...] | None = None,
            end: int | None = None, first: int | None = -1) -> "Log":
        """Appended owner `name` through `table` (a device int64 tensor of block numbers; `host`,
        `end` and `first` as `Log` takes them)."""
        return Log(self.rows[name], table, host, end, first)

    def table_tensor(self, table: tuple[int, ...]) -> torch.Tensor:
        return upload(table, torch.long, self.device)

    def copy_blocks(self, copies) -> None:
        """Copy each (from, to) block of every appended owner (before a step writes into `to`)."""
        if not copies:
            return
        source, target = upload(list(zip(*copies)), torch.long, self.device)
        for storage in self.rows.values():
            storage[target] = storage[source]

    # ---- rows ----------------------------------------------------------------------------------
    def read_rows(self, name: str, table: tuple[int, ...], stop: int) -> torch.Tensor:
        """Rows [0, stop) of appended owner `name`, gathered into one tensor."""
        held = table[:self.blocks_for(stop)]
        return self.log(name, self.table_tensor(held), held, stop).upto(stop).clone()

    def write_rows(self, name: str, table: tuple[int, ...], start: int, values: torch.Tensor) -> None:
        """Rows [start, start + len(values)) of appended owner `name` (blocks the step holds)."""
        self.log(name, self.table_tensor(table), table).write_range(start, values)

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self._free

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def held(self) -> dict[int, int]:
        """Each held block and how many tables hold it."""
        return {int(block): int(self._references[block]) for block in np.flatnonzero(self._references)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.banks.values(), *self.rows.values()))

    def __repr__(self) -> str:
        return (f"Pool(slots={self.slots}, blocks={self.blocks} of {self.block_rows} rows, "
                f"{math.ceil(self.nbytes() / 2**20)} MiB)")


class Log:
    """One appended owner of one session as a step reads and writes it: `storage` [blocks,
    block_rows, *row] through `table` [n] (a device int64 tensor): row r lies in block
    table[r // block_rows] at r % block_rows. `host`: the same table as a tuple, where the host
    knows it (an eager step), and `end`: the rows [0, end) such a step may touch.

    An eager step reads rows [0, end) as one tensor (`upto`): a view of the storage when its
    table's blocks are consecutive (as a session's blocks taken together are), else a gather
    that its later writes keep up to date, so a step that writes one row and reads all, token by
    token (a scan over a chunk), copies the rows at most once. `written`, when set, hears every
    value written (the transaction checks them)."""

    __slots__ = ("storage", "table", "host", "end", "block_rows", "written", "_first", "_seen")

    def __init__(self, storage: torch.Tensor, table: torch.Tensor, host: tuple[int, ...] | None = None,
                 end: int | None = None, first: int | None = -1):
        """`first`: the first block of `host` when its blocks are consecutive, else None (-1:
        find out)."""
        self.storage, self.table, self.host, self.end = storage, table, host, end
        self.block_rows = storage.shape[1]
        self.written = None
        self._first = (first_of_run(host) if host is not None else None) if first == -1 else first
        self._seen: torch.Tensor | None = None          # rows [0, n) as one tensor, once read

    @classmethod
    def whole(cls, storage: torch.Tensor, end: int | None = None) -> "Log":
        """A contiguous row storage [rows, *row] as one block (scratch rows, the in-place baseline)."""
        return cls(storage.unsqueeze(0), torch.zeros(1, dtype=torch.long, device=storage.device), (0,), end)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def column(self, index: int) -> "Log":
        """Column `index` of every row (of a log whose rows are tables: the routes)."""
        log = Log(self.storage[:, :, index], self.table, self.host, self.end, self._first)
        log.written = self.written
        return log

    @property
    def sees_storage(self) -> bool:
        """Whether what it reads is its storage itself (a view, or nothing read yet), so a write
        into the storage by another path (`write_rows`) shows in its reads."""
        return self._first is not None or self._seen is None

    def upto(self, end: int) -> torch.Tensor:
        """Rows [0, end) as one tensor (an eager step's: its later writes show in it)."""
        if self._first is not None:
            if self._seen is None:                      # a view: writes show in it by themselves
                self._seen = self.storage[self._first:self._first + len(self.host)].flatten(0, 1)
            return self._seen[:end]
        if self._seen is None or self._seen.shape[0] < end:
            blocks = self.table[:-(-max(end, self.end or 0) // self.block_rows)]
            self._seen = self.storage.index_select(0, blocks).flatten(0, 1)
        return self._seen[:end]

    def all(self) -> torch.Tensor:
        """Every row the table holds (a planned step reads them all, masked by position): a
        view when the host knows its blocks are consecutive, else a gather."""
        if self._first is not None:
            return self.storage[self._first:self._first + len(self.host)].flatten(0, 1)
        return self.storage.index_select(0, self.table).flatten(0, 1)

    def picking(self, end: int | None = None) -> "torch.Tensor | TabledRows":
        """Rows [0, end) (every row the table holds by default), as `upto` and `all` give them, for
        a reader that indexes a few of them (attention over the rows an indexer picked): a view
        when its blocks are consecutive, else the rows where they lie (`TabledRows`: indexing
        gathers the rows asked for, never all of them)."""
        if self._first is not None:
            return self.all()[:end]
        return TabledRows(self.storage, self.table, end)

    def lanes(self, tables: torch.Tensor) -> torch.Tensor:
        """Every lane's rows through `tables` [N, width] at once (this log's own table aside):
        [N, width * block_rows, *row] (a planned step's attention over all its lanes)."""
        return _bytes(self.storage)[tables].view(self.storage.dtype).flatten(1, 2)

    def write(self, positions: torch.Tensor, value: torch.Tensor) -> None:
        """Rows at `positions` [T] (a device int64 tensor, as a planned step has them) := value [T, *row]."""
        block, offset = self.table[positions // self.block_rows], positions % self.block_rows
        value = value.to(self.storage.dtype)
        _bytes(self.storage).index_put_((block, offset), _bytes(value))
        if self._seen is not None and self._first is None:      # a gathered copy, not a view
            _bytes(self._seen).index_put_((positions,), _bytes(value))
        self._heard(value)

    def write_rows(self, blocks: torch.Tensor, offsets: torch.Tensor, value: torch.Tensor) -> None:
        """Token t's row := value[t], at row offsets[t] of block blocks[t] (a planned step's lanes,
        or an eager step's sessions, through their tables; this log's own table aside). What it
        hears is attributed by token."""
        value = value.to(self.storage.dtype)
        _bytes(self.storage).index_put_((blocks, offsets), _bytes(value))
        self.wrote_rows(value)

    def wrote_rows(self, value: torch.Tensor) -> None:
        """`write_rows`'s value [T, *row], already in the storage's dtype, was written by an op of
        its own (one that writes the rows as it makes them): hear it as that write would."""
        if self.written is not None:
            self.written(value, by_token=True)

    def write_range(self, start: int, value: torch.Tensor) -> None:
        """Rows [start, start + len(value)) := value (an eager step's, below `end`)."""
        value, stop = value.to(self.storage.dtype), start + value.shape[0]
        if self._first is not None:
            self.upto(stop)[start:stop] = value
        else:
            at, rows = start, self.block_rows
            while at < stop:
                block, offset = divmod(at, rows)
                n = min(rows - offset, stop - at)
                self.storage[self.host[block], offset:offset + n] = value[at - start:at - start + n]
                at += n
            if self._seen is not None:
                self._seen[start:stop] = value
        self._heard(value)

    def _heard(self, value: torch.Tensor) -> None:
        if self.written is not None:
            self.written(value)


def first_of_run(table: tuple[int, ...]) -> int | None:
    """The first block of `table` when its blocks are consecutive, else None."""
    return table[0] if table and table == tuple(range(table[0], table[0] + len(table))) else None


@dataclass(frozen=True)
class TabledRows:
    """A log's rows read where they lie, `storage` [blocks, block_rows, *row] through `table` [n]:
    row r is row r % block_rows of block table[r // block_rows]. Indexing by a tensor of row
    numbers gathers those rows alone, so attention over 64 picked rows reads 64 rows, not the
    whole log (`Log.picking`); `shape` is that of rows [0, end) gathered whole (end: every row
    the table holds, by default)."""
    storage: torch.Tensor
    table: torch.Tensor
    end: int | None = None

    @property
    def shape(self) -> torch.Size:
        rows = self.table.shape[0] * self.storage.shape[1]
        return torch.Size((rows if self.end is None else min(self.end, rows), *self.storage.shape[2:]))

    def dim(self) -> int:
        return self.storage.dim() - 1

    def unsqueeze(self, dim: int) -> "TabledRows":
        """A trailing axis of one (a row's one scale beside its codes: `ops.quant.QuantizedRows`)."""
        if dim != -1:
            raise ValueError("TabledRows takes a trailing axis only (dim=-1)")
        return TabledRows(self.storage.unsqueeze(-1), self.table, self.end)

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        block_rows = self.storage.shape[1]
        return self.storage[self.table[rows // block_rows], rows % block_rows]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes are copied as the bytes they are (indexed writes take no fp8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
