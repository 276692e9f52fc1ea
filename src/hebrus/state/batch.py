"""Several sessions' one-token chunks in one pass, each session its own transaction.

A `BatchTransaction` is what the stages see when B sessions each feed one token together: row i
of every per-token tensor is session i's token, and a banked owner reads as the B sessions'
public values ([B, ...], gathered from the pool by slot and parity in one index; a write goes
back into their private banks the same way). Underneath there is one ordinary `Transaction` per session:
each write lands in that session's private bank, each row in that session's row log, and each
check (finite, status) is recorded against that session alone. So one session's NaN or failed
range check aborts that session only: the runner validates and publishes each part on its own.
"""
from __future__ import annotations

import torch

from hebrus.errors import ChunkAborted
from hebrus.state.pool import Log
from hebrus.state.txn import Transaction, abort_error


class BatchTransaction:
    def __init__(self, parts: list[Transaction], device: torch.device, banks=None):
        """`banks`: `banks_of` the parts' records, when they must be made in advance (a CUDA
        graph's capture copies nothing from the host)."""
        self.parts = parts
        self.step = None
        self.device = device
        self.pool = parts[0].pool
        self._public, self._slots = banks or self.banks_of([p.record for p in parts], device)
        self.stage = "begin"
        self.failed: dict[int, ChunkAborted] = {}          # sessions that failed alone, by index

    @staticmethod
    def banks_of(records, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the public parities, the slots) of these records, as device index tensors."""
        return (torch.tensor([r.bank for r in records], device=device),
                torch.tensor([r.slot for r in records], device=device))

    each = False            # one token per session: never a prefix transaction

    # ---- what stages use -------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """The sessions' public values of a banked owner [B, ...]: one gather from the pool (a copy)."""
        return self.pool.banks[name][self._public, self._slots]

    def write(self, name: str, value: torch.Tensor) -> None:
        """value [B, ...]: row i into session i's private bank, all in one indexed write."""
        self.pool.banks[name].index_put_((1 - self._public, self._slots), value.to(self.pool.banks[name].dtype))
        for p in self.parts:
            p.wrote(name)

    def rows(self, name: str) -> list[Log]:
        """Each session's rows of an appended owner (blocks taken privately as a transaction
        takes them). A session refused its blocks (the pool, its budget) fails alone: it gets
        scratch rows for the rest of the pass, whose results are dropped."""
        out = []
        for i, p in enumerate(self.parts):
            try:
                out.append(p.rows(name))
            except Exception as exc:
                self.failed.setdefault(i, exc if isinstance(exc, ChunkAborted) else abort_error(p.stage, exc))
                row = p.pool.rows[name]
                out.append(Log.whole(torch.zeros((p.frontier + 1,) + row.shape[2:], dtype=row.dtype,
                                                 device=self.device), p.frontier + 1))
        return out

    def carry(self, new: list[torch.Tensor], live: list[torch.Tensor]) -> None:
        """What the step's fields carry [B, ...]; each session checks and counts its own row."""
        for i, p in enumerate(self.parts):
            p.carry([v[i:i + 1] for v in new], [v[i:i + 1] for v in live])

    def flag(self, bad: torch.Tensor, bit: int) -> None:
        """bad [B, ...] (row i: session i), or one value that concerns every session."""
        for i, p in enumerate(self.parts):
            p.flag(bad[i] if bad.dim() and bad.shape[0] == len(self.parts) else bad, bit)

    def check_range(self, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        """values [B, ...]: row i is checked against session i."""
        for i, p in enumerate(self.parts):
            p.check_range(values[i:i + 1], upper, bit, lower)

    def hold(self, resource) -> None:
        """A resource the sessions' rows share: committed once every session has finished if
        any of them published, else released."""
        shared = _Shared(resource, len(self.parts))
        for p in self.parts:
            p.hold(shared)

    # ---- what the runner uses --------------------------------------------------------------
    def enter(self, index: int) -> None:
        for p in self.parts:
            p.enter(index)
        self.stage = self.parts[0].stage

    def seal(self) -> None:
        """Each session's seal; one whose memory budget refuses its share fails alone (its rows
        are still computed with the others', then dropped)."""
        for i, p in enumerate(self.parts):
            if i in self.failed:
                continue
            try:
                p.seal()
            except ChunkAborted as exc:
                self.failed[i] = exc


class _Shared:
    """One resource held by every part of a batch: it follows the batch's outcome."""

    def __init__(self, resource, parts: int):
        self.resource, self.waiting, self.published = resource, parts, False

    def commit(self) -> None:
        self.published = True
        self._finished()

    def release(self) -> None:
        self._finished()

    def _finished(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            (self.resource.commit if self.published else self.resource.release)()
