"""What one step is, as data: `StepBatch`, built once by the runner and passed to every stage.

A step feeds N sessions T tokens in all, each session its own chunk: session i's tokens are rows
bounds[i]..bounds[i+1] of every per-token tensor (`cu_seqlens` on the device), at positions
starts[i], starts[i] + 1, ... (N = 1: one session's chunk; every length 1: one token each, the
decode step of a batch). The runner says where the tokens sit (`positions`, on the device), and,
where the host knows them (an eager step), each session's first position (`starts`). A planned
step (a CUDA graph replayed at every position, `hebrus.engine.graphs`) leaves `starts` out: its
positions live on the device only, so the same captured work serves every position. Then rows
are written by index and attention looks at every row the session's block table holds, each row
past a query's own position masked; rows past the frontier must hold finite values (the pool
zeroes a block it hands out, and the runner zeroes rows an aborted chunk left), since a masked
row still meets the arithmetic with weight zero. Either way rows are read and written through
the table (`state.pool.Log`), one log per session.

Banked state reads as the session's value in a step of one session, [N, ...] in a step of
several. Stateful math runs in one of two shapes (`sublayer.scan`): one session's chunk, or
several sessions' single tokens at once (`one_each`, row i of every per-token tensor session
i's); any other step runs session by session.

What the stages hand each other travels in typed fields: `streams` (the residual streams
[T, n, D] as the last stage left them), `pending` (with one plain stream in fast mode, the last
sublayer's output, which the next sublayer adds to the streams in the kernel of its norm, and the
head before it reads them) and `terms` (each branch's value for the layers' feed-forward terms,
by the branch's place in the spec). Nothing is looked up by name.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from hebrus.uploads import upload


class Placed(NamedTuple):
    """Each token's row of an eager step of several sessions (`StepBatch.placed`), on the device:
    its block [T] and its row in that block [T], and its session's block table [T, width] (as a
    lane of a planned step has it: attention over a token's rows through it, each token a lane)."""
    blocks: torch.Tensor
    offsets: torch.Tensor
    tables: torch.Tensor


@dataclass(eq=False)
class StepBatch:
    ids: torch.Tensor                           # [T] token ids, on the device
    positions: torch.Tensor                     # [T] each token's position in its session (int64, device)
    lengths: tuple[int, ...]                    # tokens per session: N of them, each ≥ 1, summing to T
    starts: tuple[int, ...] | None              # each session's first position (host); None: a planned step
    each: bool = False                          # a prefix transaction (one session): values after every token kept
    marks: tuple[tuple[int, ...], ...] | None = None    # per session: counts of its tokens after which values are kept (see `keeps`)
    members: tuple[int, ...] | None = None      # which of the transaction's sessions these are (None: all)
    parities: torch.Tensor | None = None        # a planned step's: each lane's public bank [N] (device)
    slots: torch.Tensor | None = None           # ... its slot [N]
    tables: torch.Tensor | None = None          # ... its block table [N, width]
    blocks: torch.Tensor | None = None          # ... each token's row's block [T]
    offsets: torch.Tensor | None = None         # ... and its row in that block [T]
    streams: torch.Tensor | None = None         # the residual streams, as the last stage left them
    pending: torch.Tensor | None = None         # a sublayer's output [T, D] the next one adds to them
    terms: dict = field(default_factory=dict)   # each branch's value, by its place in the spec
    # the rows `take` gave this pass, with their tables: every layer of one rotary width shares them
    taken: list = field(default_factory=list, init=False, repr=False)
    # where `placed` found each token's row, with the sessions' tables: every owner's log shares them
    rows_placed: list = field(default_factory=list, init=False, repr=False)

    @classmethod
    def chunk(cls, ids: torch.Tensor, start: int, each: bool = False,
              marks: tuple[int, ...] | None = None) -> "StepBatch":
        """One session's chunk at host position `start` (`marks`: its counts, see `keeps`)."""
        return cls(ids, torch.arange(start, start + len(ids), device=ids.device), (len(ids),), (start,), each,
                   None if marks is None else (tuple(marks),))

    @classmethod
    def lanes(cls, ids, positions, lengths, parities, slots, tables, blocks, offsets,
              each: bool = False) -> "StepBatch":
        """A planned step: N lanes of `lengths` tokens, everything on the device (buffers the
        runner fills before each run; `blocks` and `offsets`: where each token's rows go, as
        the tables say)."""
        return cls(ids, positions, tuple(lengths), None, each, parities=parities, slots=slots, tables=tables,
                   blocks=blocks, offsets=offsets)

    @classmethod
    def ragged(cls, ids: torch.Tensor, starts, lengths, marks=None) -> "StepBatch":
        """Session i's `lengths[i]` tokens at host positions starts[i]...; ids [sum(lengths)]
        (`marks`: each session's counts, see `keeps`)."""
        if all(n == 1 for n in lengths):
            step = cls.tokens(ids, starts)
        else:
            positions = upload(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]), torch.int64,
                               ids.device)
            step = cls(ids, positions, tuple(lengths), tuple(starts))
        step.marks = None if marks is None else tuple(map(tuple, marks))
        return step

    @classmethod
    def tokens(cls, ids: torch.Tensor, starts) -> "StepBatch":
        """One token for each of N sessions at host positions `starts`."""
        return cls(ids, upload(starts, torch.int64, ids.device), (1,) * len(starts), tuple(starts))

    # ---- its shape -----------------------------------------------------------------------------
    @property
    def sessions(self) -> int:
        return len(self.lengths)

    @property
    def which(self) -> tuple[int, ...]:
        """The transaction's sessions this step covers, in order (an index into whatever the
        transaction gives per session: its row logs)."""
        return self.members if self.members is not None else tuple(range(len(self.lengths)))

    @property
    def keeps(self) -> bool:
        """Whether banked values after more tokens than the last are kept: after every token (a
        prefix transaction, `each`, one session), or after each of `marks` (per session, counts
        of its tokens, increasing, ending with all of them: the states a prefix cache keeps).
        Stages then write them stacked, with `write_each`: [T, ...], or session after session,
        each one's after its marks ([sum of the sessions' mark counts, ...], `kept_rows`)."""
        return self.each or self.marks is not None

    @cached_property
    def kept_rows(self) -> tuple[int, ...]:
        """The rows after which values are kept (`marks`), session after session: what a stage
        that keeps per-token values picks."""
        return tuple(self.bounds[i] + m - 1 for i, counts in enumerate(self.marks) for m in counts)

    @cached_property
    def kept_spans(self) -> tuple[tuple[int, int], ...]:
        """Each session's values among `kept_rows`: (first, past its last)."""
        spans, total = [], 0
        for counts in self.marks:
            spans.append((total, total + len(counts)))
            total += len(counts)
        return tuple(spans)

    @property
    def kept_last(self) -> tuple[int, ...]:
        """Where each session's last kept value (after its whole chunk) lies among `kept_rows`."""
        return tuple(b - 1 for _, b in self.kept_spans)

    @cached_property
    def one_each(self) -> bool:
        """Several sessions' single tokens: row i of every per-token tensor is session i's, and
        banked state reads [N, ...]."""
        return len(self.lengths) > 1 and all(n == 1 for n in self.lengths)

    @cached_property
    def token_a_lane(self) -> bool:
        """A planned step of one token per lane (one lane or several): what the lanes' kernels take."""
        return self.tables is not None and all(n == 1 for n in self.lengths)

    @cached_property
    def bounds(self) -> tuple[int, ...]:
        """Session i's tokens are rows bounds[i]..bounds[i+1] (host)."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[N + 1] `bounds` on the device."""
        return upload(self.bounds, torch.int32, self.ids.device)

    def windows(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sessions' rows laid out for one causal conv of `k` taps over all of them
        (`ops.conv.causal_conv_ragged`; `windows`), on the device: made once for each set of
        lengths (every layer of a pass, and every round of a pass of pieces, ask again)."""
        return windows(self.lengths, k, self.ids.device)

    @property
    def start(self):
        """One session's first position: an int, or (planned) a [1] device tensor; several
        sessions': one per session, as the choosers take them."""
        if len(self.lengths) > 1:
            if self.starts is not None:
                return list(self.starts)
            firsts = self.positions if self.one_each else self.positions[list(self.bounds[:-1])]
            return list(firsts.split(1))
        return self.starts[0] if self.starts is not None else self.positions[:1]

    def session(self, i: int) -> "StepBatch":
        """Session i's chunk alone."""
        a, b = self.bounds[i], self.bounds[i + 1]
        starts = None if self.starts is None else (self.starts[i],)
        lane = (lambda t: None) if self.tables is None else (lambda t: t[i:i + 1])
        token = (lambda t: None) if self.blocks is None else (lambda t: t[a:b])
        return StepBatch(self.ids[a:b], self.positions[a:b], (b - a,), starts, self.each,
                         None if self.marks is None else (self.marks[i],), members=(self.which[i],),
                         parities=lane(self.parities), slots=lane(self.slots), tables=lane(self.tables),
                         blocks=token(self.blocks), offsets=token(self.offsets))

    def span(self, a: int, b: int) -> "StepBatch":
        """One session's tokens a..b alone, nothing kept after them (a piece between marks)."""
        starts = None if self.starts is None else (self.starts[0] + a,)
        return StepBatch(self.ids[a:b], self.positions[a:b], (b - a,), starts, members=self.members)

    def token(self, t: int) -> "StepBatch":
        """One session's token t alone (exact mode's scan over a chunk)."""
        starts = None if self.starts is None else (self.starts[0] + t,)
        return StepBatch(self.ids[t:t + 1], self.positions[t:t + 1], (1,), starts, self.each, members=self.members)

    def rows_of(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Session i's rows of a per-token tensor."""
        return x[self.bounds[i]:self.bounds[i + 1]]

    # ---- rows by position ----------------------------------------------------------------------
    def take(self, table: torch.Tensor) -> torch.Tensor:
        """Rows of a per-position table (rotary cos/sin) at the step's positions: gathered once a
        pass over the stages (the embedding's `forget` starts one), whichever layers ask."""
        for seen, rows in self.taken:
            if seen is table:
                return rows
        if self.starts is not None and len(self.lengths) == 1:
            rows = table[self.starts[0]:self.starts[0] + len(self.ids)]
        else:
            rows = table.index_select(0, self.positions)
        self.taken.append((table, rows))
        return rows

    def forget(self) -> None:
        """A pass over the stages starts: what `take` and `placed` gave is made again (a planned
        step's positions are refilled in place between passes)."""
        self.taken.clear()
        self.rows_placed.clear()

    def lanes_log(self, logs):
        """A planned step's lanes: the one `state.pool.Log` (of `logs`, one per session of the
        transaction) that `put` writes every lane's rows into, at `blocks` and `offsets` (an op
        that writes them itself writes there, then tells it: `Log.wrote_rows`); else None."""
        return logs[self.which[0]] if self.tables is not None else None

    def put(self, logs, value: torch.Tensor) -> None:
        """Write the step's rows of a row log: `logs` holds one `state.pool.Log` per session of
        the transaction, `value` [T, *row] the rows of this step's."""
        lanes = self.lanes_log(logs)
        if lanes is not None:                       # a planned step's lanes (one or several): one write
            lanes.write_rows(self.blocks, self.offsets, value)
            return
        logs = [logs[m] for m in self.which]
        if len(logs) == 1:
            if self.starts is None:
                logs[0].write(self.positions, value)
            else:
                logs[0].write_range(self.starts[0], value)
        elif self.starts is None:
            for i, log in enumerate(logs):
                a, b = self.bounds[i], self.bounds[i + 1]
                log.write(self.positions[a:b], value[a:b])
        elif (placed := self.placed(logs)) is not None:    # every session's rows in one write
            logs[0].write_rows(placed.blocks, placed.offsets, value)
        else:
            for i, log in enumerate(logs):
                log.write_range(self.starts[i], self.rows_of(i, value))

    def placed(self, logs) -> "Placed | None":
        """Where each token's row lies in an eager step of several sessions, `logs` one per
        session (each through its session's table), made on the host once a pass for the
        sessions' tables (every log of a session has the same). None where the logs do not
        share one storage (a session refused its blocks writes scratch rows of its own) or one
        keeps a gathered copy that only its own writes keep current (`Log.sees_storage`)."""
        storage = logs[0].storage
        if any(log.storage is not storage or log.host is None or not log.sees_storage for log in logs):
            return None
        tables = [log.host for log in logs]
        for seen, where in self.rows_placed:
            if len(seen) == len(tables) and all(a is b for a, b in zip(seen, tables)):
                return where
        R, device = logs[0].block_rows, self.ids.device
        positions = [np.arange(a, a + n) for a, n in zip(self.starts, self.lengths)]
        blocks = np.concatenate([np.asarray(table, dtype=np.int64)[p // R] for table, p in zip(tables, positions)])
        each = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)      # past a table: block 0, never read
        for i, table in enumerate(tables):
            each[i, :len(table)] = table
        token_tables = each[np.repeat(np.arange(len(tables)), self.lengths)]
        T = len(blocks)                                                             # one upload for all three
        both = upload(torch.from_numpy(np.concatenate([blocks, np.concatenate(positions) % R, token_tables.ravel()])),
                      torch.int64, device)
        where = Placed(both[:T], both[T:2 * T], both[2 * T:].view(T, -1))
        self.rows_placed.append((tables, where))
        return where

    def as_blocks(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every lane's rows gathered through the tables, lane after lane ([N, width * R, ...], as
        `Log.lanes` gives them, rebuilt from a quantized cache), as blocks [N * width, R, ...] and
        the tables [N, width] that name them in that order."""
        N, W = self.tables.shape
        return rows.unflatten(1, (W, -1)).flatten(0, 1), torch.arange(N * W, device=rows.device).view(N, W)

    def visible(self, log) -> torch.Tensor:
        """The rows attention may look at in one session's step (the caller masks per query by
        `positions`): every row the log holds in a planned step, else rows [0, end)."""
        end = self._seen_end
        return log.all() if end is None else log.upto(end)

    def picking(self, log):
        """The same rows as `visible`, for a reader of a few of them: where they lie
        (`Log.picking`), not gathered whole."""
        return log.picking(self._seen_end)

    @property
    def _seen_end(self) -> int | None:
        """The end of the rows one session's step may look at: None in a planned step (every row
        its table holds)."""
        return None if self.starts is None else self.starts[0] + len(self.ids)

    def last_rows(self, X: torch.Tensor) -> torch.Tensor:
        """The rows of each session's last token, whose values are published [N, ...]."""
        if len(self.lengths) == 1:
            return X[-1:]
        if self.one_each:
            return X
        return X.index_select(0, self.lasts)

    @cached_property
    def lasts(self) -> torch.Tensor:
        """Each session's last token's row [N] on the device (indexing by a host list would copy
        it there and wait for the device)."""
        return upload([b - 1 for b in self.bounds[1:]], torch.int64, self.ids.device)


@functools.lru_cache(maxsize=64)       # (a 64-session 8K pass's: about 200 KB)
def windows(lengths: tuple[int, ...], k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.conv.causal_conv_ragged`'s layout of sequences of `lengths` rows with a conv of `k` taps:
    sequence i's state rows come first in its block, then its own rows, blocks end to end. Kept
    for the next pass of the same lengths (the tensors are only read)."""
    k1, n = k - 1, len(lengths)
    counts = torch.tensor(lengths)
    starts = torch.cumsum(counts, 0) - counts                               # each sequence's first row of x
    blocks = starts + k1 * torch.arange(n)                                  # each block's first laid-out row
    seq = torch.repeat_interleave(torch.arange(n), counts)                  # each row of x's sequence
    rows = torch.arange(int(counts.sum()))
    placed = rows + k1 * (seq + 1)                                          # each row of x, laid out
    state_at = (blocks[:, None] + torch.arange(k1)).flatten()               # each state row, laid out
    gather = torch.empty(n * k1 + len(rows), dtype=torch.int64)
    gather[placed] = n * k1 + rows
    gather[state_at] = torch.arange(n * k1)
    last = ((blocks + counts)[:, None] + torch.arange(k1)).flatten()
    return tuple(upload(torch.cat([gather, placed - k1, last]), torch.int64, device).split(
        [len(gather), len(rows), len(last)]))
