"""A session's state in the model's state pool (`state.pool`): a slot, whose two banks hold the
banked owners, and a block table, whose blocks hold the appended owners' rows.

`Published` is immutable: the slot, which bank is public, the frontier, and the block table.
`Image.public` is replaced, never mutated; that one assignment is publication. The slot and the
public table's blocks go back to the pool when the image is collected.
"""
from __future__ import annotations

import hashlib
import weakref
from typing import NamedTuple

import torch

from hebrus.state.owners import APPENDED, BANKED
from hebrus.state.pool import Pool
from hebrus.uploads import upload_into


class Published(NamedTuple):             # immutable, and made at every flip (a quarter of a frozen dataclass's time)
    slot: int
    bank: int
    frontier: int
    table: tuple[int, ...]          # the blocks of every appended owner's rows, in row order
    constraint: object = None       # what the session's next tokens must satisfy (`state.constraint`), if anything


class Image:
    def __init__(self, pool: Pool):
        """A fresh session's image: a slot taken from `pool` (`PoolFull` when none is free)."""
        self.pool, self.specs, self.device = pool, pool.specs, pool.device
        self.banked = [s for s in self.specs if s.kind == BANKED]
        self.appended = [s for s in self.specs if s.kind == APPENDED]
        slot, self.banks = pool.take_slot()
        self.public = Published(slot=slot, bank=0, frontier=0, table=())
        self._holding = _Holding(pool, slot)
        weakref.finalize(self, self._holding.release)
        # set when an aborted transaction may have written rows past the frontier; a runner that
        # reads whole blocks (a planned step masks rows rather than slicing them) zeroes them
        self.tail_dirty = False
        # called with the transaction once a chunk has passed every check, before its flip (a
        # journal's write); what it raises aborts the chunk
        self.before_flip = None
        self._device_table: torch.Tensor | None = None     # the public table, for planned steps
        self._uploaded: tuple[int, ...] | None = None

    @property
    def slot(self) -> int:
        return self.public.slot

    def room(self, rows: int = 1) -> bool:
        """Whether the public table holds the next `rows` rows in blocks of this image's own
        (not shared with a fork): a planned step writes them where they are."""
        record = self.public
        return self.pool.exclusive(record.table, record.frontier, record.frontier + rows)

    def clean_tails(self) -> None:
        """Zero every row past the public frontier that the public table holds (private rows
        only: blocks of this image's own, as a shared block is never written)."""
        if self.tail_dirty:
            record = self.public
            stop = len(record.table) * self.pool.block_rows
            if stop > record.frontier:
                table = self.device_table()
                positions = torch.arange(record.frontier, stop, device=self.device)
                for spec in self.appended:
                    log = self.pool.log(spec.name, table)
                    log.write(positions, torch.zeros((len(positions), *spec.shape), dtype=spec.dtype,
                                                     device=self.device))
            self.tail_dirty = False

    def device_table(self) -> torch.Tensor:
        """The public table as a device tensor that stays where it is (a planned step reads it,
        and a captured graph finds it there): its first len(table) entries, kept current."""
        table = self.public.table
        if self._device_table is None:
            self._device_table = torch.zeros(self.pool.blocks_for(self.pool.max_rows), dtype=torch.long,
                                             device=self.device)
        if self._uploaded != table:
            upload_into(self._device_table[:len(table)], table)
            self._uploaded = table
        return self._device_table[:len(table)]

    def read(self, name: str) -> torch.Tensor:
        """The public value of a banked owner."""
        return self.banks[self.public.bank][name]

    def rows(self, name: str) -> torch.Tensor:
        """The public rows [0, frontier) of an appended owner (a copy)."""
        return self.value(name)

    def held_rows(self, name: str) -> torch.Tensor:
        """Every row of an appended owner that the public table holds, past the frontier too
        (what a planned step reads, masked): a copy."""
        return self.pool.log(name, self.pool.table_tensor(self.public.table)).all()

    def value(self, name: str, record: Published | None = None) -> torch.Tensor:
        """The value of any owner in `record` (default: the public one): a banked owner's tensor,
        or a copy of an appended owner's rows below the frontier."""
        record = self.public if record is None else record
        if name in self.pool.rows:
            return self.pool.read_rows(name, record.table, record.frontier)
        return self.banks[record.bank][name]

    def publish(self, record: Published) -> None:
        self.public = record                                    # the publication point
        self._holding.table = record.table

    def digest(self) -> str:
        """`digest` of every owner's value, all taken from one published record. The caller
        keeps the next transaction from writing meanwhile."""
        record = self.public
        return digest({spec.name: self.value(spec.name, record) for spec in self.specs})

    def held_bytes(self) -> int:
        """The pool's bytes this image holds: its slot and its table's blocks."""
        return self.pool.slot_nbytes + len(self.public.table) * self.pool.block_nbytes

    def fork(self, copy_rows: bool = False) -> "Image":
        """A new image (another slot) with this one's public state: the public bank copied, the
        constraint the same value, and the table's blocks shared (held once more), or with
        `copy_rows` copied into blocks of its own. `PoolFull` (nothing taken) when the pool has
        no slot or blocks for it."""
        record = self.public
        other = self._other({})
        if copy_rows:
            other.install({spec.name: self.value(spec.name, record) for spec in self.appended}, record.frontier,
                          record.constraint)
        else:
            other.publish(Published(other.slot, 0, record.frontier, self.pool.share(record.table), record.constraint))
        return other

    def prefix(self, frontier: int, banked: dict[str, torch.Tensor], constraint=None) -> "Image":
        """A new image (another slot) at `frontier`, no further than this one's: this one's rows
        below it (the blocks that hold them shared, held once more), the banked values `banked`
        (an owner it does not name: this one's public value) and `constraint`. `PoolFull`
        (nothing taken) when the pool has no slot."""
        record = self.public
        if not 0 <= frontier <= record.frontier:
            raise ValueError(f"a prefix ends at most at the frontier {record.frontier}, not at {frontier}")
        other = self._other(banked)
        other.publish(Published(other.slot, 0, frontier, self.pool.share(record.table[:self.pool.blocks_for(frontier)]),
                                constraint))
        return other

    def _other(self, banked: dict[str, torch.Tensor]) -> "Image":
        """A new image whose bank 0 holds this one's public values, those of `banked` instead
        where it names them (a fork's, a prefix's). It will read this one's blocks, so the rows
        past the frontier are zeroed first."""
        self.clean_tails()
        other = Image(self.pool)
        for name, value in self.banks[self.public.bank].items():
            other.banks[0][name].copy_(banked.get(name, value))
        return other

    def install(self, rows: dict[str, torch.Tensor], frontier: int, constraint=None) -> None:
        """A fresh image's rows [0, frontier) of every appended owner (a restore, a copy), into
        blocks it takes (`PoolFull`, nothing taken, when they are not free), and its constraint;
        the banks are the caller's to fill (bank 0, which stays public)."""
        plan = self.pool.writable((), 0, frontier)
        for spec in self.appended:
            self.pool.write_rows(spec.name, plan.table, 0, rows[spec.name].to(self.device))
        self.publish(Published(self.slot, 0, frontier, plan.table, constraint))


class _Holding:
    """What an image holds in its pool, released when the image is collected."""

    def __init__(self, pool: Pool, slot: int):
        self.pool, self.slot, self.table = pool, slot, ()

    def release(self) -> None:
        self.pool.release(self.table)
        self.pool.free_slot(self.slot)


def digest(values: dict[str, torch.Tensor]) -> str:
    """SHA-256 over each owner's name, dtype, shape and bytes, in the order given (the owner
    table's): what `Session.digest` returns, and what a saved session is checked against."""
    h = hashlib.sha256()
    for name, value in values.items():
        h.update(f"{name}|{str(value.dtype).removeprefix('torch.')}|{tuple(value.shape)}|".encode())
        h.update(tensor_bytes(value))
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in memory order, on the host (a view where it already is one): what
    digests and fingerprints hash."""
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
