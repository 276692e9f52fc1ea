"""What one step is, as data: `StepBatch`, built once by the runner and passed to every stage.

A step feeds N sessions (N = 1 for one session's chunk) T tokens in all: session i's tokens are
rows cu_seqlens[i]..cu_seqlens[i+1] of every per-token tensor, at positions starts[i]... The
runner says where they sit (`positions`, on the device), and, where the host knows them (an
eager step), each session's first position (`starts`). A planned step (a CUDA graph replayed at
every position, `hebrus.engine.graphs`) leaves `starts` out: its positions live on the device
only, so the same captured work serves every position. Then rows are written by index and
attention looks at every row the session's block table holds, each row past a query's own
position masked; rows past the frontier must hold finite values (the pool zeroes a block it hands
out, and the runner zeroes rows an aborted chunk left), since a masked row still meets the
arithmetic with weight zero. Either way rows are read and written through the table
(`state.pool.Log`).

What the stages hand each other travels in typed fields: `streams` (the residual streams
[T, n, D] as the last stage left them) and `terms` (each branch's value for the layers'
feed-forward terms, by the branch's place in the spec). Nothing is looked up by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(eq=False)
class StepBatch:
    ids: torch.Tensor                           # [T] token ids, on the device
    positions: torch.Tensor                     # [T] each token's position in its session (int64, device)
    lengths: tuple[int, ...]                    # tokens per session: N of them, summing to T
    starts: tuple[int, ...] | None              # each session's first position (host); None: a planned step
    each: bool = False                          # a prefix transaction: values after every token are kept
    one_each: bool = False                      # sessions' tokens one each, banked state read [N, ...]
    streams: torch.Tensor | None = None         # the residual streams, as the last stage left them
    terms: dict = field(default_factory=dict)   # each branch's value, by its place in the spec

    @classmethod
    def chunk(cls, ids: torch.Tensor, start: int, each: bool = False) -> "StepBatch":
        """One session's chunk at host position `start`."""
        return cls(ids, torch.arange(start, start + len(ids), device=ids.device), (len(ids),), (start,), each)

    @classmethod
    def planned(cls, ids: torch.Tensor, start: torch.Tensor, each: bool = False) -> "StepBatch":
        """One session's chunk at the device position `start` [1] (a planned step)."""
        return cls(ids, start + torch.arange(len(ids), device=ids.device), (len(ids),), None, each)

    @classmethod
    def tokens(cls, ids: torch.Tensor, starts) -> "StepBatch":
        """One token for each of N sessions: `starts` host ints, or [1] device tensors (planned)."""
        if starts and isinstance(starts[0], torch.Tensor):
            return cls(ids, torch.cat(starts), (1,) * len(starts), None, one_each=True)
        return cls(ids, torch.tensor(starts, dtype=torch.int64, device=ids.device), (1,) * len(starts), tuple(starts),
                   one_each=True)

    # ---- its shape -----------------------------------------------------------------------------
    @property
    def row_per_session(self) -> bool:
        """Sessions' tokens one each (any number of them): row i of every per-token tensor is
        session i's, and banked state reads [N, ...]."""
        return self.one_each

    @property
    def start(self):
        """One session's first position: an int, or (planned) a [1] device tensor; several
        sessions': one per session, as the choosers take them."""
        if self.row_per_session:
            return list(self.starts) if self.starts is not None else list(self.positions.split(1))
        return self.starts[0] if self.starts is not None else self.positions[:1]

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[N + 1]: session i's tokens are rows cu_seqlens[i]..cu_seqlens[i+1]."""
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        return torch.tensor(bounds, dtype=torch.int32, device=self.ids.device)

    def token(self, t: int) -> "StepBatch":
        """One session's token t alone (exact mode's scan over a chunk)."""
        starts = None if self.starts is None else (self.starts[0] + t,)
        return StepBatch(self.ids[t:t + 1], self.positions[t:t + 1], (1,), starts, self.each)

    def session(self, i: int) -> "StepBatch":
        """Session i's part of a step of one token each."""
        starts = None if self.starts is None else (self.starts[i],)
        return StepBatch(self.ids[i:i + 1], self.positions[i:i + 1], (1,), starts)

    # ---- rows by position ----------------------------------------------------------------------
    def take(self, table: torch.Tensor) -> torch.Tensor:
        """Rows of a per-position table (rotary cos/sin) at the step's positions."""
        if self.starts is not None and not self.row_per_session:
            return table[self.starts[0]:self.starts[0] + len(self.ids)]
        return table.index_select(0, self.positions)

    def put(self, rows, value: torch.Tensor) -> None:
        """Write the step's rows of a row log (a `state.pool.Log`; one per session when there are
        several)."""
        if self.row_per_session:
            for i, log in enumerate(rows):
                self.session(i).put(log, value[i:i + 1])
        elif self.starts is None:
            rows.write(self.positions, value)
        else:
            rows.write_range(self.starts[0], value)

    def visible(self, rows) -> torch.Tensor:
        """The rows attention may look at (the caller masks per query by `positions`): every
        row the log holds in a planned step, else rows [0, end)."""
        return rows.all() if self.starts is None else rows.upto(self.starts[0] + len(self.ids))

    def last_rows(self, X: torch.Tensor) -> torch.Tensor:
        """The rows of each session's last token, whose values are published."""
        return X if self.row_per_session else X[-1:]
