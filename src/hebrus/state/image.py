"""A session's state: two banks of banked owners, appended row storage, and the public record.

`Published` is immutable: which bank is public, the frontier, and the storage of every appended
owner. `Image.public` is replaced, never mutated; that one assignment is publication.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from hebrus.state.owners import APPENDED, BANKED, OwnerSpec


@dataclass(frozen=True, slots=True)
class Published:
    bank: int
    frontier: int
    storages: tuple[torch.Tensor, ...]      # one per appended owner, in spec order


class Image:
    def __init__(self, specs: list[OwnerSpec], device: torch.device):
        self.specs = specs
        self.device = device
        self.banked = [s for s in specs if s.kind == BANKED]
        self.appended = [s for s in specs if s.kind == APPENDED]
        # an appended owner's place in `appended` and in a record's `storages`
        self.storage_index = {s.name: i for i, s in enumerate(self.appended)}
        self.banks = tuple(
            {s.name: torch.full(s.shape, s.fill, dtype=s.dtype, device=device) for s in self.banked}
            for _ in range(2)
        )
        empty = tuple(torch.empty((0,) + s.shape, dtype=s.dtype, device=device) for s in self.appended)
        self.public = Published(bank=0, frontier=0, storages=empty)
        # set when an aborted transaction may have written rows past the frontier; a runner that
        # reads whole storages (a planned step masks rows rather than slicing them) zeroes them
        self.tail_dirty = False
        # called with the transaction once a chunk has passed every check, before its flip (a
        # journal's write); what it raises aborts the chunk
        self.before_flip = None
        # ids of row storages another session's image holds too (a fork's): their rows below the
        # frontier are read by both, so a chunk never writes them in place but into a copy
        self.shared: set[int] = set()

    def share(self, other: "Image") -> None:
        """Make `other`'s public record this image's rows (a fork), both marking them shared."""
        ids = {id(st) for st in other.public.storages}
        self.shared |= ids
        other.shared |= ids

    def room(self, rows: int = 1) -> bool:
        """Whether every row log can take the next `rows` rows in place: the capacity past the
        frontier, and not shared with another session."""
        record = self.public
        return all(st.shape[0] >= record.frontier + rows and id(st) not in self.shared for st in record.storages)

    def clean_tails(self) -> None:
        """Zero every appended storage past the public frontier (private rows only)."""
        if self.tail_dirty:
            for storage in self.public.storages:
                storage[self.public.frontier:].zero_()
            self.tail_dirty = False

    def read(self, name: str) -> torch.Tensor:
        """The public value of a banked owner."""
        return self.banks[self.public.bank][name]

    def rows(self, name: str) -> torch.Tensor:
        """The public rows [0, frontier) of an appended owner."""
        return self.public.storages[self.storage_index[name]][: self.public.frontier]

    def value(self, name: str, record: Published | None = None) -> torch.Tensor:
        """The value of any owner in `record` (default: the public one): a banked owner's tensor,
        or an appended owner's rows below the frontier."""
        record = self.public if record is None else record
        if name in self.storage_index:
            return record.storages[self.storage_index[name]][: record.frontier]
        return self.banks[record.bank][name]

    def publish(self, record: Published) -> None:
        self.public = record                                    # the publication point

    def digest(self) -> str:
        """`digest` of every owner's value, all taken from one published record. The caller
        keeps the next transaction from writing meanwhile."""
        record = self.public
        return digest({spec.name: self.value(spec.name, record) for spec in self.specs})


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
