"""Where a chunk sits in a session: its positions, as a layer reads and writes row logs by them.

A stage learns the chunk's first position from the transaction (`txn.start`). The eager runner
gives a Python int: rows are sliced, and attention looks at rows [0, end). A planned step (a
CUDA graph replayed at every position, `hebrus.engine.graphs`) gives a one-element device
tensor instead, so the same captured work serves every position: attention looks at every row
the session's block table holds, each row past a query's own position masked. Rows past the
frontier then must hold finite values (the pool zeroes a block it hands out, and the runner
zeroes rows an aborted chunk left), since a masked row still meets the arithmetic with weight
zero. Either way rows are read and written through the table (`state.pool.Log`).
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
        """Write the chunk's rows of a row log (`state.pool.Log`); for sessions, `rows` holds
        one log per session."""
        if self.sessions:
            for i, log in enumerate(rows):
                self.one(i).put(log, value[i:i + 1])
        elif self.planned:
            rows.write(self.positions, value)
        else:
            rows.write_range(self.start, value)

    def visible(self, rows) -> torch.Tensor:
        """The rows attention may look at (the caller masks per query by `positions`): every
        row the log holds in a planned step, else rows [0, end)."""
        return rows.all() if self.planned else rows.upto(self.start + self.length)
