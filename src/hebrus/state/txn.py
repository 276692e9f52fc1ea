"""One chunk, one transaction.

Stages read the public image and write only private places: the other bank of the session's
slot, and rows [start, start + length) of appended owners, in blocks of the session's own (blocks
a chunk takes from the pool, or copies of blocks shared with a fork, are private until the flip
and go back to the pool if it aborts). `seal` closes each stage's bookkeeping, `validate` reads every device-side check back
in one transfer, and `publish` copies the output to the caller and flips the public record.
Anything that raises before the flip leaves the public image as it was.

A prefix transaction (`each=True`) keeps every banked owner's value after each token of the
chunk in scratch (`write_each`); once the chunk has passed its checks, `keep(k)` makes the
values after token k the private bank's and the frontier start + k, so the flip publishes the
chunk's first k tokens. The rejected tail's rows lie past the frontier, unpublished; nothing is
copied to undo them.

A planned transaction (`planned=True`) is the static plan of a one-token step that a CUDA graph
captures once and replays at every position (`hebrus.engine.graphs`): stages see the chunk's
start as a device tensor (the public bank's frontier owner), the session's table must already hold
the row in a block of its own (no block is taken inside a graph), and `restart` re-arms the
host-side bookkeeping for each replay.
"""
from __future__ import annotations

import enum

import torch

from hebrus.errors import (AllocationError, ChunkAborted, CommandError, DeviceStatusError,
                           NonFiniteError, PageReadError, StructuralError)
from hebrus.state.budget import MemoryBudget, Refused, out_of_memory
from hebrus.state.image import Image, Published
from hebrus.state.interrupts import deferred_signals
from hebrus.state.pool import Log, PoolFull, first_of_run
from hebrus.state.status import Completion, DeviceChecks, describe


def abort_error(stage: str, exc: Exception) -> ChunkAborted:
    """The failure kind of an exception raised inside a transaction: an allocation failure, a
    page of a paged table that could not be read (device work that could not be done: the
    command kind), or else a structural one."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PageReadError):
        return CommandError(stage, detail)
    return AllocationError(stage, detail) if out_of_memory(exc) else StructuralError(stage, detail)


class Transaction:
    """A chunk of `length` tokens over `image`. Whoever builds it names what the seam does not
    know (`engine.eager.transaction`): the `stages` in order, the banked owner that holds the
    frontier (`frontier_owner`, kept up to date by the transaction itself), the banked owner
    `publish` copies out (`output`), and the flag class of the bits the stages' checks set
    (`check_bits`), by which a failed status word is described."""

    def __init__(self, image: Image, length: int, stages: list[str], budget: MemoryBudget,
                 max_rows: int, *, frontier_owner: str, output: str, check_bits: type[enum.Flag],
                 planned: bool = False, reserve: int = 0, each: bool = False):
        record = image.public
        self.image, self.record, self.planned, self.each = image, record, planned, each
        self.after_each: dict[str, torch.Tensor] = {}     # a prefix transaction's values after every token
        self.frontier, self.length = record.frontier, length
        self.chunk_length = length                  # `length` is what is published: `keep` may cut it
        self.public = image.banks[record.bank]
        self.private = image.banks[1 - record.bank]
        self.pool = image.pool
        self.table = record.table               # the table the flip publishes: blocks taken appended
        self._table: torch.Tensor | None = None  # it on the device, once a stage asks for rows
        self._taken: list[int] = []             # blocks taken from the pool (released on abort)
        self._dropped: tuple[int, ...] = ()     # shared blocks replaced by copies (released on publish)
        self.step = None                            # the `StepBatch` the runner passes the stages
        self.stages, self.budget = stages, budget
        self.checks = DeviceChecks(defer=planned)
        self.max_rows = max_rows
        self.frontier_owner, self.output, self.check_bits = frontier_owner, output, check_bits
        self.reserve = min(reserve, max_rows)   # rows the table is extended to after the stages, if granted
        self.completion = Completion(image.device)
        self.stage_index, self.stage = -1, "begin"
        self.written: set[str] = set()
        self._writes: list[torch.Tensor] = []       # what the current stage wrote
        self._value_bytes = 0
        self._working = 0                           # bytes of what the step's fields carry between stages
        self._accounts: list[tuple[int, int, str]] = []     # (growth, working, stage) per seal
        self._peak: tuple[int, str] | None = None           # a planned step's largest request
        self._rows_handed = False
        self._held: list = []                       # resources committed with the chunk (`hold`)
        self._done = False
        self._cut = False                           # `keep` left rows past the new frontier
        budget.begin()
        if frontier_owner in self.private:
            if planned:
                torch.add(self.public[frontier_owner], length, out=self.private[frontier_owner])
            else:
                self.private[frontier_owner].fill_(self.frontier + length)
            self.written.add(frontier_owner)

    # ---- what stages use -------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """Public value of a banked owner. Never write to it."""
        return self.public[name]

    def write(self, name: str, value: torch.Tensor) -> None:
        """Store the new value of a banked owner in the private bank."""
        self.private[name].copy_(value)
        self.wrote(name)

    def write_each(self, name: str, values: torch.Tensor) -> None:
        """A prefix transaction's values of a banked owner after every token of the chunk [T, ...]:
        the last is written as `write` writes, all are kept (and checked) for `keep`."""
        self.write(name, values[-1])
        self.after_each[name] = values
        self._writes.append(values)
        self._value_bytes += values.numel() * values.element_size()

    def keep(self, k: int) -> int:
        """Publish only the chunk's first k tokens (a prefix transaction, after `validate`): the
        banked values after token k become the private bank's and the frontier moves by k. The
        rows of the tokens after k stay past the frontier, never public. Returns k."""
        if not self.each:
            raise StructuralError("keep", "only a prefix transaction keeps part of its chunk")
        if 0 < k < self.length:
            missing = sorted(n for n in self.written if n != self.frontier_owner and n not in self.after_each)
            if missing:
                raise StructuralError("keep", f"no value after every token for {', '.join(missing)}")
            for name, values in self.after_each.items():
                self.private[name].copy_(values[k - 1])
            if self.frontier_owner in self.private:
                self.private[self.frontier_owner].fill_(self.frontier + k)
            self.length, self._cut = k, True
        return k

    def wrote(self, name: str) -> None:
        """The bookkeeping of `write` for a private value already stored (a batch stores every
        session's in one multi-tensor copy)."""
        target = self.private[name]
        self.written.add(name)
        self._writes.append(target)
        self._value_bytes += target.numel() * target.element_size()

    def rows(self, name: str) -> Log:
        """An appended owner's rows through the session's table, which holds rows
        [start, start+length) in blocks of its own: rows below `start` are the public ones, rows
        [start, start+length) are this chunk's to write."""
        if self._table is None:
            self._table = self._writable_table()
            self._first = first_of_run(self.table)
        self._rows_handed = True
        if self.planned:                    # the public table: a captured graph reads it as it was
            log = self.pool.log(name, self._table, self.record.table, first=self._first)
        else:
            log = self.pool.log(name, self._table, self.table, self.frontier + self.length, self._first)
        log.written = self._hear
        return log

    def _hear(self, rows: torch.Tensor) -> None:
        """Rows a stage wrote: checked (finite) with the rest of what it wrote."""
        self._writes.append(rows)

    def hold(self, resource) -> None:
        """Commit `resource` with this chunk's publication, or release it if the chunk aborts."""
        self._held.append(resource)

    def carry(self, new: list[torch.Tensor], live: list[torch.Tensor]) -> None:
        """What the step's fields carry between stages after this one (`StepBatch.streams`,
        `.terms`): `new`, what this stage put there, is checked with its writes; `live`, all of
        it, is the working set the memory budget counts."""
        self._writes += new
        self._working = sum(v.numel() * v.element_size() for v in live)

    def flag(self, bad: torch.Tensor, bit: int) -> None:
        """Device-side check: set `bit` in this stage's status word if any of `bad` is true."""
        self.checks.flag(self.stage_index, bad, bit)

    def check_range(self, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        """Device-side check: set `bit` unless every value lies in [lower, upper)."""
        self.checks.check_range(self.stage_index, values, upper, bit, lower)

    # ---- what the runner uses --------------------------------------------------------------
    def enter(self, index: int) -> None:
        """Begin the stage `stages[index]`: its index is the cell of its checks and completion."""
        self.stage_index, self.stage = index, self.stages[index]
        self._writes, self._value_bytes = [], 0

    def seal(self) -> None:
        """Queue the finite checks of everything this stage wrote, admit what it emitted and
        wrote to the memory budget (the values it keeps; its scratch tensors are not counted),
        and record its completion."""
        self.checks.finite(self.stage_index, self._writes)
        working = self._working
        growth = max(working - self.budget.working + self._value_bytes, 0)
        self._accounts.append((growth, working, self.stage))
        self._account(growth, working, self.stage)
        self.completion.record(self.stage_index)

    def restart(self) -> None:
        """Re-arm a planned transaction for a replay of its captured work at the public record
        now (same bank parity and storage as at capture): the memory budget hears the largest of
        the requests the stages made (so it refuses exactly when one of them would be refused),
        and nothing is marked failed or finished."""
        record = self.image.public
        same = record.bank == self.record.bank and record.table == self.record.table
        if not (self.planned and same) or self._held:      # held resources are one chunk's, never replayed
            raise StructuralError("begin", "a planned step replayed on an image it was not captured for")
        self.record, self.frontier, self._done = record, record.frontier, False
        self.length, self._cut = self.chunk_length, False          # a replay's `keep` chooses again
        self.completion.restart()
        self.budget.begin()
        if self._peak is None:              # each stage asked for working-so-far + its growth
            working, peak = 0, (0, "begin")
            for growth, after, stage in self._accounts:
                peak = max(peak, (working + growth, stage), key=lambda p: p[0])
                working = after
            self._peak = peak
        needed, self.stage = self._peak
        self._request(self.budget.admit, needed, f"the intermediates of {self.stage}")
        self.budget.set_working(self._accounts[-1][1] if self._accounts else 0)
        self.stage = self.stages[0]         # a replay's own failures: a graph cannot say which stage

    def poison(self) -> None:
        """Write a NaN into the last floating-point tensor this stage wrote (fault injection)."""
        target = next(t for t in reversed(self._writes) if t.is_floating_point() and t.numel())
        target.view(-1)[0] = float("nan")

    def validate(self, values: list[float] | None = None) -> None:
        """Raise the failure of the earliest failing stage, if any. `values`: this transaction's
        folded checks, when a batch brought several transactions' back in one transfer."""
        missing = [s.name for s in self.image.banked if s.name not in self.written]
        if missing:
            raise StructuralError("validate", f"banked owners not written by any stage: {', '.join(missing)}")
        try:
            words, nonfinite = self.checks.read(values)              # the one host sync
        except Exception as exc:
            if out_of_memory(exc):
                raise AllocationError("validate", f"{type(exc).__name__}: {exc}") from exc
            raise CommandError("validate", f"device work failed: {exc}") from exc
        failures = []
        incomplete = self.completion.first_incomplete()
        if incomplete is not None:
            failures.append((incomplete, 0, CommandError, "submitted work did not complete"))
        for index, word in words.items():
            failures.append((index, 1, DeviceStatusError,
                             f"status word 0x{word:x} ({describe(word, self.check_bits)})"))
        for index in nonfinite:
            failures.append((index, 2, NonFiniteError, "a write of this stage is not finite"))
        if failures:
            index, _, cls, detail = min(failures, key=lambda f: (f[0], f[1]))
            raise cls(self.stages[index], detail)

    def publish(self, out: torch.Tensor | None = None) -> None:
        """Copy the output to the caller, then make the private image public in one assignment.

        `out` must already be known to accept the copy (the session checks it before the
        transaction begins). Signals are held until both are done, so the caller's buffer and
        the public image never disagree; an exception a held signal raises comes after the
        flip, from the end of this call, and the chunk stays published."""
        if self._done:
            raise StructuralError("publish", "transaction already finished")
        released = len(self._dropped) * self.pool.block_nbytes
        record = Published(self.record.slot, 1 - self.record.bank, self.frontier + self.length, self.table)
        with deferred_signals():
            self._copy_out(out)
            self.image.publish(record)
            self._done = True
            self._taken = []
            self.pool.release(self._dropped)
            if self._cut:                           # the rejected tail's rows, past the frontier
                self.image.tail_dirty = True
            try:
                self.budget.commit(released)
            finally:
                _finish_all(self._held, "commit")

    def _copy_out(self, out: torch.Tensor | None) -> None:
        if out is None:
            return
        try:
            out.copy_(self.private[self.output])
        except Exception as exc:
            raise StructuralError("publish", f"could not write out: {type(exc).__name__}: {exc}") from exc

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.budget.abort()
            self.pool.release(self._taken)
            self._taken = []
            _finish_all(self._held, "release")
            if self._rows_handed:                   # rows past the frontier may hold anything now
                self.image.tail_dirty = True

    # ---- internals -------------------------------------------------------------------------
    def extend_reserved(self) -> None:
        """After the last stage: extend the table to `reserve` rows, with blocks taken if the
        pool has them free and the budget grants them. Asked for only once every stage has made
        its own requests, so a reservation never takes what the chunk needed, and one that is
        refused is skipped, never an abort."""
        if not self.planned and self.reserve:
            self._extend(self.reserve)

    def _blocks(self, count: int) -> str:
        return f"{count} block{'s' if count != 1 else ''} of {self.pool.block_rows} rows"

    def _writable_table(self) -> torch.Tensor:
        """The table whose blocks hold this chunk's rows, its own: in a planned step the public
        one as it is; else blocks taken for rows past the table's end (and, when it must grow,
        up to twice its rows if they are free) and copies of shared blocks the chunk writes into."""
        need = self.frontier + self.length
        if self.planned:
            if not self.pool.exclusive(self.record.table, self.frontier, need):
                raise StructuralError(self.stage, f"a planned step needs rows {self.frontier}..{need - 1} held, in "
                                      f"blocks of the session's own")
            return self.image.device_table()
        if self.pool.exclusive(self.record.table, self.frontier, need):     # as it is: the table held
            return self.image.device_table()
        try:
            plan = self.pool.writable(self.record.table, self.frontier, self.length)
        except PoolFull as exc:
            raise AllocationError(self.stage, str(exc)) from None
        if plan.taken:
            try:
                self._request(self.budget.grow, len(plan.taken) * self.pool.block_nbytes, self._blocks(len(plan.taken)))
            except AllocationError:
                self.pool.release(plan.taken)
                raise
        self._taken += plan.taken
        self.pool.copy_blocks(plan.copies)
        self.table, self._dropped = plan.table, plan.dropped
        held = len(self.record.table) * self.pool.block_rows
        if need > held:                      # growing: room for as many rows again, if it is free
            self._extend(max(need, 2 * held, self.pool.block_rows))
        return self.pool.table_tensor(self.table)

    def _extend(self, rows: int) -> None:
        more = self.pool.extend(self.table, min(rows, self.max_rows))
        if not more:
            return
        try:
            self.budget.grow(len(more) * self.pool.block_nbytes, self._blocks(len(more)))
        except Refused:
            self.pool.release(more)
            return
        self._taken += more
        self.table += more

    def _account(self, growth: int, working: int, stage: str) -> None:
        self._request(self.budget.admit, growth, f"the intermediates of {stage}")
        self.budget.set_working(working)

    def _request(self, ask, nbytes: int, what: str) -> None:
        try:
            ask(nbytes, what)
        except Refused as exc:
            raise AllocationError(self.stage, str(exc)) from None


def _finish_all(resources: list, how: str) -> None:
    """`resource.commit()` or `.release()` on every one, even if one of them raises (the first
    exception is raised after all are finished)."""
    error = None
    for resource in resources:
        try:
            getattr(resource, how)()
        except BaseException as exc:       # noqa: BLE001 - re-raised below, after the others
            error = error or exc
    if error is not None:
        raise error
