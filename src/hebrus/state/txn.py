"""One chunk, one transaction: a step of N sessions' chunks is N transactions in one object.

Stages read the public image and write only private places: the other bank of each session's
slot, and rows [start, start + length) of appended owners, in blocks of the session's own (blocks
a chunk takes from the pool, or copies of blocks shared with a fork, are private until the flip
and go back to the pool if it aborts). `seal` closes each stage's bookkeeping, `failures` reads
every device-side check back in one transfer and says, per session, what failed, and `publish`
copies a session's output to the caller and flips its public record. Anything that raises
before a session's flip leaves its public image as it was.

Every check is kept per session (`state.status.DeviceChecks`): a tensor a stage wrote or checked
is attributed by its first dimension (T: per token, N: per session; a scalar concerns all), and
rows by the session whose log they were written through. So one session's NaN, failed range
check, refused blocks or refused budget fails that session alone (`_Session.failure`), while the
others go on and publish; an exception the pass raises fails them all.

A prefix transaction (`each=True`, one session) keeps every banked owner's value after each token of the
chunk in scratch (`write_each`); once the chunk has passed its checks, `keep(k)` makes the
values after token k the private bank's and the frontier start + k, so the flip publishes the
chunk's first k tokens. The rejected tail's rows lie past the frontier, unpublished; nothing is
copied to undo them.

A planned transaction (`lanes`, a planned `StepBatch`) is the static plan of a step that a CUDA
graph captures once and replays for any sessions at any positions (`hebrus.engine.graphs`): the
step runs over B lanes whose ids, positions, bank parities, slots and block tables are device
tensors the runner fills before each run; the first n lanes are this transaction's sessions, the
rest padding that reads and writes the pool's scratch slot and block. Blocks are taken on the
host when the transaction begins (a graph takes none), so stages find every table holding its
session's rows. A replay is a new transaction over whichever sessions run it that borrows the
captured one's device work (`template`): its checks, completion record and values kept per
token, and the largest request its stages made of a lane's memory budget (`admit_peaks` asks
each session's budget for it, once the replay is on its way).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from hebrus.errors import (AllocationError, ChunkAborted, CommandError, DeviceStatusError,
                           NonFiniteError, PageReadError, PoolExhausted, StructuralError)
from hebrus.state.budget import MemoryBudget, Refused, out_of_memory
from hebrus.state.context import InPlace
from hebrus.state.image import Image, Published
from hebrus.state.interrupts import deferred_signals
from hebrus.state.pool import Log, PoolFull, first_of_run
from hebrus.state.status import Completion, DeviceChecks, describe
from hebrus.uploads import upload


def abort_error(stage: str, exc: Exception) -> ChunkAborted:
    """The failure kind of an exception raised inside a transaction: an allocation failure, a
    page of a paged table that could not be read (device work that could not be done: the
    command kind), or else a structural one."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PageReadError):
        return CommandError(stage, detail)
    return AllocationError(stage, detail) if out_of_memory(exc) else StructuralError(stage, detail)


def banks_of(records, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the public parities, the slots) of these records, as device index tensors: how a step of
    several sessions reads their banks."""
    both = upload([[r.bank for r in records], [r.slot for r in records]], torch.long, device)
    return both[0], both[1]


class _Session:
    """One session's share of a step: its public record and chunk, the table its flip publishes
    and the blocks taken for it, its memory budget, what it holds, and its failure, once it has
    failed alone."""
    __slots__ = ("image", "record", "budget", "reserve", "frontier", "length", "chunk_length", "public", "private",
                 "table", "device_table", "first", "taken", "dropped", "held", "working", "accounts", "peak",
                 "failure", "done", "tokens")

    def __init__(self, image: Image, length: int, budget: MemoryBudget, reserve: int):
        record = image.public
        self.image, self.record, self.budget, self.reserve = image, record, budget, reserve
        self.frontier, self.length = record.frontier, length
        self.chunk_length = length                  # `length` is what is published: `keep` may cut it
        self.public = image.banks[record.bank]
        self.private = image.banks[1 - record.bank]
        self.table = record.table               # the table the flip publishes: blocks taken appended
        self.device_table: torch.Tensor | None = None     # it on the device, once a stage asks for rows
        self.first: int | None = None
        self.taken: list[int] = []              # blocks taken from the pool (released on abort)
        self.dropped: tuple[int, ...] = ()      # shared blocks replaced by copies (released on publish)
        self.held: list = []                    # resources committed with the chunk (`hold`)
        self.working = 0                        # bytes of its share of what the step's fields carry
        self.accounts: list[tuple[int, int, str]] = []     # (growth, working, stage) per seal
        self.peak: tuple[int, str] | None = None           # a planned step's largest request
        self.failure: ChunkAborted | None = None
        self.done = False
        self.tokens = None                      # its chunk's ids on the host, where its record has a constraint


class Transaction:
    """Chunks of `lengths[i]` tokens over `images[i]`, one transaction each, run as one step.
    Whoever builds it names what the seam does not know (`engine.eager.transaction`): the
    `stages` in order, the banked owner that holds the frontier (`frontier_owner`, kept up to
    date by the transaction itself), the banked owner `publish` copies out (`output`), and the
    flag class of the bits the stages' checks set (`check_bits`), by which a failed status word
    is described. `reserve`: rows each session's table is extended to after the stages, if
    granted (one number for all, or one per session). `lanes` and `template`: a planned step's
    (above). `tokens`: each session's chunk of ids (a host sequence or tensor), which the
    constraint in its record (`state.constraint`), if any, takes to the value its flip publishes."""

    def __init__(self, images: list[Image], lengths: list[int], stages: list[str], budgets: list[MemoryBudget],
                 max_rows: int, *, frontier_owner: str, output: str, check_bits: type[enum.Flag],
                 reserve: int | list[int] = 0, each: bool = False, lanes=None, template: "Captured | None" = None,
                 tokens=None):
        if each and len(images) != 1:
            raise StructuralError("begin", "a prefix transaction is one session's chunk")
        reserves = reserve if isinstance(reserve, (list, tuple)) else [reserve] * len(images)
        self.parts = [_Session(image, n, budget, min(r, max_rows))
                      for image, n, budget, r in zip(images, lengths, budgets, reserves)]
        for i, p in enumerate(self.parts):
            if p.record.constraint is not None:
                if tokens is None:
                    raise StructuralError("begin", "a session with a constraint needs its chunk's tokens")
                ids = tokens[i]
                p.tokens = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        self.sessions = len(self.parts)
        self.pool, self.device = images[0].pool, images[0].device
        self.planned, self.lanes, self.each = lanes is not None, lanes, each
        self.step = None                            # the `StepBatch` the runner passes the stages
        self.stages, self.max_rows = stages, max_rows
        self.frontier_owner, self.output, self.check_bits = frontier_owner, output, check_bits
        self.stage_index, self.stage = -1, "begin"
        self._writes: list[tuple[torch.Tensor, int | None]] = []    # this stage's: (tensor, its session or None)
        self._value_bytes = 0                       # bytes of banked values this stage wrote, per session
        self._own_bytes: dict[int, int] = {}        # ... and those one session wrote alone (by its index)
        self._rows_handed = self.planned
        self._cut = False                           # `keep` left rows past the new frontier
        self.pass_failed = False                    # `failures` found the pass itself failed
        # a planned step's device work runs over its lanes; an eager one's over its sessions
        self._width = lanes.sessions if self.planned else self.sessions
        if self.planned:
            self._public, self._slots = lanes.parities, lanes.slots
        elif self.sessions > 1:
            self._public, self._slots = banks_of([p.record for p in self.parts], self.device)
        # each session's part of a per-token tensor (a planned step's: a lane's)
        self._share = [1 / self._width] * self.sessions if self.planned else [n / sum(lengths) for n in lengths]
        if template is not None:                    # a replay: the captured step's device work
            self.checks, self.completion = template.checks, template.completion
            self.written, self.after_each, self._peak = template.written, template.after_each, template.peak
            self.completion.restart()
        else:
            # a planned step's or a token each's finite checks wait for the step's end, all in one
            # reduction (those writes are a few rows each; a longer chunk's are checked stage by stage, so
            # that none of them is kept past its stage)
            self.checks = DeviceChecks(defer=self.planned or max(lengths) == 1,
                                       lengths=list(lanes.lengths) if self.planned else list(lengths), device=self.device)
            self.completion = Completion(self.device)
            self.written: set[str] = set()
            self.after_each: dict[str, torch.Tensor] = {}     # values after every token, or each mark (`write_each`)
        for p in self.parts:
            p.budget.begin()
            if not self.planned and frontier_owner in p.private:
                p.private[frontier_owner].fill_(p.frontier + p.length)
        if self.planned:
            self._tables()
        if frontier_owner in self.parts[0].private and not self.planned:
            self.written.add(frontier_owner)

    # ---- one session's (a chunk's) ------------------------------------------------------------
    @property
    def _one(self) -> _Session:
        if self.sessions != 1:
            raise StructuralError(self.stage, "this transaction holds several sessions' chunks")
        return self.parts[0]

    image = property(lambda self: self._one.image)
    record = property(lambda self: self._one.record)
    frontier = property(lambda self: self._one.frontier)
    length = property(lambda self: self._one.length)
    public = property(lambda self: self._one.public)
    private = property(lambda self: self._one.private)
    budget = property(lambda self: self._one.budget)

    # ---- what stages use -------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """Public value of a banked owner (several sessions': [N, ...], gathered from the pool by
        slot and parity: a copy). Never write to it."""
        if self.sessions == 1 and not self.planned:
            return self.parts[0].public[name]
        value = self.pool.banks[name][self._public, self._slots]
        return value[0] if self._width == 1 else value

    def write(self, name: str, value: torch.Tensor) -> None:
        """Store the new value of a banked owner in the private bank (several sessions': value
        [N, ...], row i into session i's, in one indexed write)."""
        if self.sessions == 1 and not self.planned:
            target = self.parts[0].private[name]
            target.copy_(value)
        else:
            bank = self.pool.banks[name]
            target = value.to(bank.dtype)
            rows = target.unsqueeze(0) if self._width == 1 else target
            bank.index_put_((self._private_parities, self._slots), rows)
        self.written.add(name)
        self._writes.append((target, None))
        self._value_bytes += self.parts[0].private[name].nbytes

    def in_place(self, name: str) -> InPlace | None:
        """Where a kernel reads a banked owner's public values and writes its private ones
        itself, with no gather before and no scatter after (`state.context.InPlace`: the public
        parities are its sources, the private ones its targets); then the stage calls `wrote`.
        A planned step offers it (its lanes' states, one lane or several); any other step None."""
        if not self.planned:
            return None
        return InPlace(self.pool.banks[name], self._public, self._private_parities, self._slots)

    @cached_property
    def _private_parities(self) -> torch.Tensor:
        """The private bank of each lane or session, as a device tensor: made once a step, by
        the first stage that writes (so a captured step makes it inside its graph, from the
        parities each replay is given)."""
        return 1 - self._public

    def wrote(self, name: str, check: torch.Tensor) -> None:
        """A kernel wrote `name`'s private values (`in_place`); `check` [N, ...] is finite
        exactly where they are (checked with the stage's writes)."""
        self.written.add(name)
        self._writes.append((check, None))
        self._value_bytes += self.parts[0].private[name].nbytes

    def write_each(self, name: str, values: torch.Tensor) -> None:
        """A banked owner's values after every token of the chunk [T, ...] (a prefix
        transaction), or after each session's marks [M, ...], session after session
        (`StepBatch.marks`, `kept_last`): each session's last, after its whole chunk, is written
        as `write` writes, all are kept (and checked, each session's as its own) for `keep` or
        for the caller."""
        if self.sessions == 1:
            self.write(name, values[-1])
            self._writes.append((values, 0))
            self._value_bytes += values.numel() * values.element_size()
        else:                               # each session's own values, checked and counted as its own
            self.write(name, values[list(self.step.kept_last)])
            for i, (a, b) in enumerate(self.step.kept_spans):
                mine = values[a:b]
                self._writes.append((mine, i))
                j = self.step.which[i]
                self._own_bytes[j] = self._own_bytes.get(j, 0) + mine.numel() * mine.element_size()
        self.after_each[name] = values

    def check_each(self, stage: str) -> None:
        """Refuse (`StructuralError` at `stage`) a chunk whose stages wrote a banked owner without its
        values after every token or mark (`write_each`): what is kept must be every value."""
        missing = sorted(n for n in self.written if n != self.frontier_owner and n not in self.after_each)
        if missing:
            raise StructuralError(stage, f"no value after every token or mark for {', '.join(missing)}")

    def keep(self, k: int) -> int:
        """Publish only the chunk's first k tokens (a prefix transaction, after `validate`): the
        banked values after token k become the private bank's and the frontier moves by k. The
        rows of the tokens after k stay past the frontier, never public. A constraint in the
        record keeps k to the tokens it allows. Returns k."""
        if not self.each:
            raise StructuralError("keep", "only a prefix transaction keeps part of its chunk")
        p = self._one
        if p.tokens is not None:                    # no further than its constraint allows
            k = min(k, p.record.constraint.allows(p.tokens))
        if 0 < k < p.length:
            self.check_each("keep")
            for name, values in self.after_each.items():
                p.private[name].copy_(values[k - 1])
            if self.frontier_owner in p.private:
                p.private[self.frontier_owner].fill_(p.frontier + k)
            p.length, self._cut = k, True
        return k

    def rows(self, name: str) -> list[Log]:
        """An appended owner's rows, one `Log` per session, each through its session's table,
        which holds rows [start, start+length) in blocks of its own: rows below `start` are the
        public ones, rows [start, start+length) are this chunk's to write. A session refused its
        blocks (the pool, its budget) fails alone: it gets scratch rows for the rest of the pass,
        whose results are dropped."""
        self._rows_handed = True
        if self.planned:                    # every lane through its row of the step's tables
            storage, logs = self.pool.rows[name], []
            for lane in range(self._width):
                log = Log(storage, self.lanes.tables[lane], first=None)
                log.written = partial(self._hear, lane)
                logs.append(log)
            return logs
        if any(p.failure is None and p.device_table is None for p in self.parts):
            self._tables()
        logs = []
        for i, p in enumerate(self.parts):
            if p.failure is not None:
                row = self.pool.rows[name]
                log = Log.whole(torch.zeros((p.frontier + p.length,) + row.shape[2:], dtype=row.dtype,
                                            device=self.device), p.frontier + p.length)
            else:
                log = self.pool.log(name, p.device_table, p.table, p.frontier + p.length, p.first)
            log.written = partial(self._hear, i)
            logs.append(log)
        return logs

    def _tables(self) -> None:
        """Each session's table for its chunk's rows (`_writable_table`), the blocks they take
        zeroed together (one fill per row storage, where each session's were one each). A
        session refused its blocks fails alone; blocks that cannot be zeroed fail every session
        (theirs go back when the step is finished). An eager step also finds whether each table's
        blocks are consecutive (`first`: its logs read a view); a planned step's lanes read through
        their tables, and it goes on when every session has failed (a replay runs them all)."""
        stop = not self.planned
        try:
            with self.pool.zeroing_together():
                for p in self.parts:
                    if p.failure is None and p.device_table is None:
                        try:
                            p.device_table = self._writable_table(p)
                            if not self.planned:
                                p.first = first_of_run(p.table)
                        except Exception as exc:
                            self._fail(p, exc, stop)
        except ChunkAborted:
            raise
        except Exception as exc:
            for p in self.parts:
                if p.failure is None:
                    self._fail(p, exc, stop)

    def _hear(self, session: int, rows: torch.Tensor, by_token: bool = False) -> None:
        """Rows a stage wrote for `session` (`by_token`: for every session, a row per token):
        checked (finite) with the rest of what it wrote."""
        self._writes.append((rows, None if by_token else session))

    def hold(self, resource) -> None:
        """Commit `resource` with this step's publication, or release it if it aborts (with
        several sessions: once each has finished, committed if any published)."""
        if self.sessions > 1:
            resource = _Shared(resource, self.sessions)
        for p in self.parts:
            p.held.append(resource)

    def carry(self, new: list[torch.Tensor], live: list[torch.Tensor]) -> None:
        """What the step's fields carry between stages after this one (`StepBatch.streams`,
        `.terms`, per token): `new`, what this stage put there, is checked with its writes;
        `live`, all of it, is the working set the memory budget counts, each session its share."""
        self._writes += [(v, None) for v in new]
        working = sum(v.numel() * v.element_size() for v in live)
        for p, share in zip(self.parts, self._share):
            p.working = int(working * share)

    def flag(self, bad: torch.Tensor, bit: int) -> None:
        """Device-side check: set `bit` in this stage's status word of each session any of whose
        `bad` is true (`bad` [T, ...] or [N, ...], or a scalar for every session)."""
        self.checks.flag(self.stage_index, bad, bit)

    def check_range(self, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        """Device-side check: set `bit` for each session unless every one of its values lies in
        [lower, upper)."""
        self.checks.check_range(self.stage_index, values, upper, bit, lower)

    # ---- what the runner uses --------------------------------------------------------------
    def enter(self, index: int) -> None:
        """Begin the stage `stages[index]`: its index is the cell of its checks and completion."""
        self.stage_index, self.stage = index, self.stages[index]
        self._writes, self._value_bytes, self._own_bytes = [], 0, {}

    def seal(self) -> None:
        """Queue the finite checks of everything this stage wrote, admit what it emitted and
        wrote to each session's memory budget (the values it keeps; its scratch tensors are not
        counted), and record its completion."""
        self.checks.finite(self.stage_index, self._writes)
        what, values, own = f"the intermediates of {self.stage}", self._value_bytes, self._own_bytes
        for j, p in enumerate(self.parts):          # (a step of 64 sessions seals each of them at every stage)
            if p.failure is None:
                budget = p.budget
                growth = max(p.working - budget.working + values + own.get(j, 0), 0)
                p.accounts.append((growth, p.working, self.stage))
                try:
                    self._request(budget.admit, growth, what)
                except ChunkAborted as exc:
                    self._fail(p, exc)
                    continue
                budget.set_working(p.working)
        self.completion.record(self.stage_index)

    def advance(self) -> None:
        """A planned step's private frontier: each lane's last position + 1 (device work, so a
        captured graph holds it)."""
        if self.frontier_owner in self.parts[0].private:
            last = self.lanes.positions.view(self._width, -1)[:, -1] + 1
            self.write(self.frontier_owner, last if self._width > 1 else last[0])

    def admit_peaks(self) -> None:
        """A replay's budgets: each session's is asked for the largest request the captured
        stages made of a lane's (so it refuses exactly when one of them would have refused).
        Asked once the replay is launched, while the device runs it (a refused session's lane
        wrote only private places); a refusal fails that session alone."""
        (needed, stage), working = self._peak
        what, self.stage = f"the intermediates of {stage}", stage
        try:
            for p in self.parts:
                if p.failure is None:
                    try:
                        self._request(p.budget.admit, needed, what)
                        p.budget.set_working(working)
                    except Exception as exc:
                        self._fail(p, exc, stop=False)
        finally:
            self.stage = self.stages[0]     # a replay's own failures: a graph cannot say which stage

    def banks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the public parities, the slots) of the step's sessions as device index tensors: the
        ones the step reads through where it has them (a planned step's inputs, a step of
        several sessions), so asking makes no host transfer."""
        if self.planned or self.sessions > 1:
            return self._public[:self.sessions], self._slots[:self.sessions]
        return banks_of([p.record for p in self.parts], self.device)

    def captured(self) -> "Captured":
        """What a replay of this (captured) step borrows. The peak: the largest request of a
        lane's budget (working-so-far + a stage's growth, and the stage), and the working bytes
        it ends with; every lane runs the same work, so the first session's accounts are every
        lane's."""
        working, peak = 0, (0, "begin")
        for growth, after, stage in self.parts[0].accounts:
            peak = max(peak, (working + growth, stage), key=lambda x: x[0])
            working = after
        return Captured(self.checks, self.completion, self.written, self.after_each, (peak, working))

    def poison(self, session: int | None = None) -> None:
        """Write a NaN into the last floating-point value this stage wrote (fault injection);
        with `session`, into the last one written for that session alone."""
        first = sum(self.checks.lengths[:session or 0])     # the session's first token
        for t, who in reversed(self._writes):
            if not (t.is_floating_point() and t.numel()):
                continue
            target = t
            if session is not None and self.sessions > 1:
                if who is not None:
                    if who != session:
                        continue
                elif t.dim() and t.shape[0] == self.sessions:
                    target = t[session]
                elif t.dim() and t.shape[0] == self.checks.tokens:
                    target = t[first]
                else:
                    continue
            target.view(-1)[0] = float("nan")
            return

    def failures(self) -> list[ChunkAborted | None]:
        """Each session's failure, or None: the earliest failing stage's, from every check read
        back in one transfer."""
        missing = [s.name for s in self.parts[0].image.banked if s.name not in self.written]
        if missing:
            error = StructuralError("validate", f"banked owners not written by any stage: {', '.join(missing)}")
            self.pass_failed = True
            return [p.failure or error for p in self.parts]
        try:
            checks = self.checks.read(self.sessions)       # the one host sync
        except Exception as exc:
            cls = AllocationError if out_of_memory(exc) else CommandError
            error = cls("validate", f"{type(exc).__name__}: {exc}" if cls is AllocationError
                        else f"device work failed: {exc}")
            self.pass_failed = True
            return [p.failure or error for p in self.parts]
        incomplete = self.completion.first_incomplete()
        self.pass_failed = incomplete is not None
        out = []
        for p, (words, nonfinite) in zip(self.parts, checks):
            failures = []
            if incomplete is not None:
                failures.append((incomplete, 0, CommandError, "submitted work did not complete"))
            for index, word in words.items():
                failures.append((index, 1, DeviceStatusError,
                                 f"status word 0x{word:x} ({describe(word, self.check_bits)})"))
            for index in nonfinite:
                failures.append((index, 2, NonFiniteError, "a write of this stage is not finite"))
            if p.failure is not None or not failures:
                out.append(p.failure)
                continue
            index, _, cls, detail = min(failures, key=lambda f: (f[0], f[1]))
            out.append(cls(self.stages[index], detail))
        return out

    def validate(self) -> None:
        """Raise the failure of the earliest failing stage of a chunk (one session's), if any."""
        self._one                                   # several sessions' are read by `failures`
        failure = self.failures()[0]
        if failure is not None:
            raise failure

    def publish(self, out: torch.Tensor | None = None, session: int = 0) -> None:
        """Copy `session`'s output to the caller, then make its private image public in one
        assignment.

        `out` must already be known to accept the copy (the session checks it before the
        transaction begins). Signals are held until both are done, so the caller's buffer and
        the public image never disagree; an exception a held signal raises comes after the
        flip, from the end of this call, and the chunk stays published."""
        p = self.parts[session]
        if p.done:
            raise StructuralError("publish", "transaction already finished")
        record = Published(p.record.slot, 1 - p.record.bank, p.frontier + p.length, p.table, self._constraint(p))
        with deferred_signals():
            if out is not None:
                self._copy_out(p, out)
            p.image.publish(record)
            p.done, p.taken = True, []
            if p.dropped:
                self.pool.release(p.dropped)
            if self._cut:                           # the rejected tail's rows, past the frontier
                p.image.tail_dirty = True
            try:
                p.budget.commit(len(p.dropped) * self.pool.block_nbytes)
            finally:
                if p.held:
                    _finish_all(p.held, "commit")

    def _constraint(self, p: _Session):
        """The constraint `p`'s flip publishes: its record's, after the tokens it publishes."""
        constraint = p.record.constraint
        if p.tokens is None or not p.length:
            return constraint
        try:                                        # the tokens were checked before the chunk ran
            return constraint.after(p.tokens[:p.length])
        except Exception as exc:
            raise StructuralError("publish", f"the constraint failed: {type(exc).__name__}: {exc}") from exc

    def _copy_out(self, p: _Session, out: torch.Tensor) -> None:
        try:
            out.copy_(p.private[self.output])
        except Exception as exc:
            raise StructuralError("publish", f"could not write out: {type(exc).__name__}: {exc}") from exc

    def abort(self) -> None:
        """Finish every session not yet published: nothing of it published, its blocks back."""
        for p in self.parts:
            if not p.done:
                p.done = True
                p.budget.abort()
                self.pool.release(p.taken)
                p.taken = []
                _finish_all(p.held, "release")
                if self._rows_handed:               # rows past the frontier may hold anything now
                    p.image.tail_dirty = True

    # ---- internals -------------------------------------------------------------------------
    def _fail(self, p: _Session, exc: Exception, stop: bool = True) -> None:
        """`p` fails alone (the others go on); when no session is left, the step stops here
        (with `stop`)."""
        p.failure = exc if isinstance(exc, ChunkAborted) else abort_error(self.stage, exc)
        if stop and all(q.failure is not None for q in self.parts):
            raise p.failure

    def extend_reserved(self) -> None:
        """After the last stage: extend each table to its `reserve` rows, with blocks taken if
        the pool has them free and the budget grants them. Asked for only once every stage has
        made its own requests, so a reservation never takes what the chunk needed, and one that
        is refused is skipped, never an abort."""
        with self.pool.zeroing_together():
            for p in self.parts:
                if p.reserve and p.failure is None:
                    self._extend(p, p.reserve)

    def _blocks(self, count: int) -> str:
        return f"{count} block{'s' if count != 1 else ''} of {self.pool.block_rows} rows"

    def _writable_table(self, p: _Session) -> torch.Tensor | None:
        """The table whose blocks hold this chunk's rows, its own: the public one as it is, or
        with blocks taken for rows past the table's end (and, when it must grow, up to twice its
        rows if they are free) and copies of shared blocks the chunk writes into. (A planned
        step's tables are the step's input: None.)"""
        need = p.frontier + p.length
        if self.pool.exclusive(p.record.table, p.frontier, need):     # as it is: the table held
            return None if self.planned else p.image.device_table()
        try:
            plan = self.pool.writable(p.record.table, p.frontier, p.length)
        except PoolFull as exc:
            raise PoolExhausted(self.stage, str(exc)) from None
        if plan.taken:
            try:
                self._request(p.budget.grow, len(plan.taken) * self.pool.block_nbytes, self._blocks(len(plan.taken)))
            except AllocationError:
                self.pool.release(plan.taken)
                raise
        p.taken += plan.taken
        self.pool.copy_blocks(plan.copies)
        p.table, p.dropped = plan.table, plan.dropped
        held = len(p.record.table) * self.pool.block_rows
        if need > held:                      # growing: room for as many rows again, if it is free
            self._extend(p, max(need, 2 * held, self.pool.block_rows))
        return None if self.planned else self.pool.table_tensor(p.table)

    def _extend(self, p: _Session, rows: int) -> None:
        more = self.pool.extend(p.table, min(rows, self.max_rows))
        if not more:
            return
        try:
            p.budget.grow(len(more) * self.pool.block_nbytes, self._blocks(len(more)))
        except Refused:
            self.pool.release(more)
            return
        p.taken += more
        p.table += more

    def _request(self, ask, nbytes: int, what: str) -> None:
        try:
            ask(nbytes, what)
        except Refused as exc:
            raise AllocationError(self.stage, str(exc)) from None


@dataclass(frozen=True)
class Captured:
    """A captured step's device work, which every replay of it shares: its checks and completion
    record, the banked owners its stages write, a prefix transaction's values after every token,
    and a lane's peak request of its memory budget (`Transaction.captured`)."""
    checks: DeviceChecks
    completion: Completion
    written: set
    after_each: dict
    peak: tuple


class _Shared:
    """One resource held by every session of a step: it follows the step's outcome (committed
    once every session has finished if any of them published, else released)."""

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
