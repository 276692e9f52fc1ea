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
        self.slot = {s.name: i for i, s in enumerate(self.appended)}
        self.banks = tuple(
            {s.name: torch.full(s.shape, s.fill, dtype=s.dtype, device=device) for s in self.banked}
            for _ in range(2)
        )
        empty = tuple(torch.empty((0,) + s.shape, dtype=s.dtype, device=device) for s in self.appended)
        self.public = Published(bank=0, frontier=0, storages=empty)

    def read(self, name: str) -> torch.Tensor:
        """The public value of a banked owner."""
        return self.banks[self.public.bank][name]

    def rows(self, name: str) -> torch.Tensor:
        """The public rows [0, frontier) of an appended owner."""
        return self.public.storages[self.slot[name]][: self.public.frontier]

    def value(self, name: str) -> torch.Tensor:
        """The public value of any owner: a banked owner's tensor, or an appended owner's rows."""
        return self.rows(name) if name in self.slot else self.read(name)

    def publish(self, record: Published) -> None:
        self.public = record                                    # the publication point

    def digest(self) -> str:
        """SHA-256 over each owner's name, dtype, shape and bytes, in spec order, all taken from
        one published record. The caller keeps the next transaction from writing meanwhile."""
        record, h = self.public, hashlib.sha256()
        for spec in self.specs:
            if spec.kind == BANKED:
                value = self.banks[record.bank][spec.name]
            else:
                value = record.storages[self.slot[spec.name]][: record.frontier]
            h.update(f"{spec.name}|{str(value.dtype).removeprefix('torch.')}|{tuple(value.shape)}|".encode())
            h.update(value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
