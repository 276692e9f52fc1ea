"""Where a chunk sits in a session: its positions, as a layer reads and writes row logs by them.

A stage learns the chunk's first position from the transaction (`txn.start`). The eager runner
gives a Python int: rows are sliced, and attention looks at rows [0, end). A planned step (a
CUDA graph replayed at every position, `hebrus.engine.graphs`) gives a one-element device
tensor instead, so the same captured work serves every position: rows are gathered and
scattered by index, and attention looks at the whole storage, every row past a query's own
position masked. Storage past the frontier then must hold finite values (the runner keeps it
zeroed), since a masked row still meets the arithmetic with weight zero.
"""
from __future__ import annotations

from functools import cached_property

import torch


class Span:
    """Positions start..start+length-1 of a chunk; `start` an int or a [1] int64 tensor. Or,
    for several sessions feeding one token each (`state.batch`), `start` is the list of their
    positions (ints, or [1] tensors in a planned step): row i is session i's token, and row logs
    come as one storage per session."""

    def __init__(self, start, length: int, device: torch.device):
        self.start, self.length, self.device = start, length, device
        self.sessions = isinstance(start, list)
        self.planned = isinstance(start[0] if self.sessions else start, torch.Tensor)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[T] int64 on the device (one per row)."""
        if self.sessions:
            if self.planned:
                return torch.cat(self.start)
            return torch.tensor(self.start, dtype=torch.int64, device=self.device)
        return torch.arange(self.length, device=self.device) + self.start

    def one(self, i: int) -> "Span":
        """Session i's own span (sessions only)."""
        return Span(self.start[i], 1, self.device)

    def take(self, table: torch.Tensor) -> torch.Tensor:
        """Rows of a per-position table (rotary cos/sin) at the chunk's positions."""
        if self.planned or self.sessions:
            return table.index_select(0, self.positions)
        return table[self.start:self.start + self.length]

    def put(self, rows, value: torch.Tensor) -> None:
        """Write the chunk's rows of a row log (or of a view of one) in place; for sessions,
        `rows` holds one per session."""
        if self.sessions:
            for i, log in enumerate(rows):
                self.one(i).put(log, value[i:i + 1])
        elif self.planned:
            value = value.to(rows.dtype)
            if rows.dtype == torch.float8_e4m3fn:       # fp8 codes: copied as the bytes they are
                rows, value = rows.view(torch.uint8), value.view(torch.uint8)
            rows.index_copy_(0, self.positions, value)
        else:
            rows[self.start:self.start + self.length] = value

    def visible(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows attention may look at (the caller masks per query by `positions`)."""
        return rows if self.planned else rows[:self.start + self.length]
