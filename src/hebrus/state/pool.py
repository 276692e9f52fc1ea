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
from dataclasses import dataclass

import torch

from hebrus.state.owners import APPENDED, BANKED, OwnerSpec


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
    def __init__(self, specs: list[OwnerSpec], device: torch.device, slots: int, blocks: int, block_rows: int):
        if slots < 1 or blocks < 0 or block_rows < 1:
            raise ValueError(f"a pool needs a slot and a positive block size, got slots={slots}, "
                             f"blocks={blocks}, block_rows={block_rows}")
        self.specs, self.device = specs, device
        self.slots, self.blocks, self.block_rows = slots, blocks, block_rows
        self.banks = {s.name: torch.full((2, slots, *s.shape), s.fill, dtype=s.dtype, device=device)
                      for s in specs if s.kind == BANKED}
        self.rows = {s.name: torch.zeros((blocks, block_rows, *s.shape), dtype=s.dtype, device=device)
                     for s in specs if s.kind == APPENDED}
        self._free_slots = list(range(slots - 1, -1, -1))      # popped from the end: slot 0 first
        self._free_blocks = list(range(blocks - 1, -1, -1))
        self._references = [0] * blocks
        self._fills = {s.name: s.fill for s in specs if s.kind == BANKED}

    @staticmethod
    def slot_bytes(specs: list[OwnerSpec]) -> int:
        """Bytes a slot takes: both banks of every banked owner."""
        return 2 * sum(s.nbytes for s in specs if s.kind == BANKED)

    @staticmethod
    def block_bytes(specs: list[OwnerSpec], block_rows: int) -> int:
        """Bytes a block takes: `block_rows` rows of every appended owner."""
        return block_rows * sum(s.nbytes for s in specs if s.kind == APPENDED)

    @classmethod
    def carve(cls, specs: list[OwnerSpec], device: torch.device, pool_bytes: int, slots: int | None = None,
              block_rows: int = 16) -> "Pool":
        """A pool of at most `pool_bytes`: `slots` slots (default: as many as half the bytes
        hold, at least one) and blocks from the rest."""
        per_slot, per_block = cls.slot_bytes(specs), cls.block_bytes(specs, block_rows)
        if slots is None:
            slots = max(1, pool_bytes // 2 // max(per_slot, 1))
        left = pool_bytes - slots * per_slot
        if left < 0:
            raise PoolFull(f"{slots} slots of {per_slot} bytes do not fit a pool of {pool_bytes} bytes")
        blocks = left // per_block if per_block else 0
        return cls(specs, device, slots, blocks, block_rows)

    # ---- slots ---------------------------------------------------------------------------------
    def take_slot(self) -> int:
        """A free slot, its banks reset to every owner's fill."""
        if not self._free_slots:
            raise PoolFull(f"all {self.slots} slots hold sessions")
        slot = self._free_slots.pop()
        for name, bank in self.banks.items():
            bank[:, slot].fill_(self._fills[name])
        return slot

    def copy_slot(self, source: int, parity: int, target: int) -> None:
        """Bank `parity` of slot `source` into the same bank of slot `target` (a fork's)."""
        for bank in self.banks.values():
            bank[parity, target] = bank[parity, source]

    def free_slot(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not held")
        self._free_slots.append(slot)

    # ---- blocks --------------------------------------------------------------------------------
    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_rows)

    def share(self, table: tuple[int, ...]) -> tuple[int, ...]:
        """The same blocks held once more (a fork's table)."""
        for block in table:
            self._references[block] += 1
        return table

    def release(self, blocks) -> None:
        """Hold each block once less; a block no one holds is free."""
        for block in blocks:
            if self._references[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self._references[block] -= 1
            if self._references[block] == 0:
                self._free_blocks.append(block)

    def writable(self, table: tuple[int, ...], frontier: int, rows: int) -> Rows:
        """What a step that writes rows [frontier, frontier + rows) needs: the blocks past the
        table's end, and a copy of every shared block it writes into. Takes them, or raises
        `PoolFull` having taken nothing."""
        first, end = frontier // self.block_rows, self.blocks_for(frontier + rows)
        shared = [i for i in range(first, min(end, len(table))) if rows and self._references[table[i]] > 1]
        wanted = len(shared) + max(0, end - len(table))
        if wanted > len(self._free_blocks):
            raise PoolFull(f"a step of {rows} rows needs {wanted} blocks; {len(self._free_blocks)} of "
                           f"{self.blocks} are free")
        taken = [self._take_block() for _ in range(wanted)]
        new, copies = list(table), []
        for i, block in zip(shared, taken):
            new[i] = block
            copies.append((table[i], block))
        new += taken[len(shared):]
        return Rows(tuple(new), tuple(taken), tuple(copies), tuple(table[i] for i in shared))

    def _take_block(self) -> int:
        block = self._free_blocks.pop()
        self._references[block] = 1
        return block

    def copy_blocks(self, copies) -> None:
        """Copy each (from, to) block of every appended owner (before a step writes into `to`)."""
        if not copies:
            return
        source = torch.tensor([a for a, _ in copies], device=self.device)
        target = torch.tensor([b for _, b in copies], device=self.device)
        for storage in self.rows.values():
            storage[target] = storage[source]

    # ---- rows ----------------------------------------------------------------------------------
    def locate(self, table: tuple[int, ...], start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) index tensors of rows [start, stop) of a session with `table`."""
        positions = torch.arange(start, stop, device=self.device)
        blocks = torch.tensor(table, dtype=torch.long, device=self.device)
        return blocks[positions // self.block_rows], positions % self.block_rows

    def read_rows(self, name: str, table: tuple[int, ...], stop: int) -> torch.Tensor:
        """Rows [0, stop) of appended owner `name`, gathered into one tensor."""
        block, offset = self.locate(table, 0, stop)
        return self.rows[name][block, offset]

    def write_rows(self, name: str, table: tuple[int, ...], start: int, values: torch.Tensor) -> None:
        """Rows [start, start + len(values)) of appended owner `name` (blocks the step holds)."""
        block, offset = self.locate(table, start, start + len(values))
        self.rows[name][block, offset] = values

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def held(self) -> dict[int, int]:
        """Each held block and how many tables hold it."""
        return {block: n for block, n in enumerate(self._references) if n}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.banks.values(), *self.rows.values()))

    def __repr__(self) -> str:
        return (f"Pool(slots={self.slots}, blocks={self.blocks} of {self.block_rows} rows, "
                f"{math.ceil(self.nbytes() / 2**20)} MiB)")
