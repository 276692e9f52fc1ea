"""Several sessions stepped together: each its own chunk (one token, or a prompt's tokens), one
pass through the stages, one transaction per session (`state.txn`, a step of N sessions). The
stages run once for all of them, so the weights are read once for the step's tokens; each
session is then validated (all their checks come back in one transfer) and published on its
own, so a NaN or a failed check in one session's rows aborts that session only; so does a
refusal of its row storage's growth or of its share of the intermediates (its memory budget
sees what it would see alone). Any other exception in the shared pass cannot be pinned on one
session and aborts them all.
"""
from __future__ import annotations

import torch

from hebrus import faults
from hebrus.engine.eager import OUTPUT, run_chunk, run_stages, transaction
from hebrus.engine.graphs import capture
from hebrus.errors import AllocationError, ChunkAborted, CommandError
from hebrus.layers.owners import FRONTIER
from hebrus.state.step import StepBatch
from hebrus.state.budget import out_of_memory
from hebrus.state.interrupts import deferred_signals
from hebrus.state.txn import Transaction, abort_error, banks_of


def run_step(model, sessions, chunks: list[torch.Tensor], outs, reserve: list[int] | None = None) -> list:
    """chunks[i]: session i's token ids (the caller holds every session's lock, in inference
    mode). Returns, per session, its last logits (`outs[i]` or a new tensor) or the
    `ChunkAborted` that aborted it. `reserve[i]`: rows session i's storage is extended to after
    the pass, if granted (see `Transaction.extend_reserved`)."""
    reserve = reserve or [s.reserve for s in sessions]
    lengths = [len(c) for c in chunks]
    txn = transaction(model, [s.image for s in sessions], [s.budget for s in sessions], lengths, reserve=reserve)
    ids = torch.cat(list(chunks)).to(model.device)

    def work() -> None:             # no fault is armed here: its injection points do nothing
        run_stages(model, txn, StepBatch.ragged(ids, [p.frontier for p in txn.parts], lengths))
        txn.extend_reserved()

    return _conclude(model, txn, work, sessions, chunks, outs)


def _conclude(model, txn: Transaction, work, sessions, chunks, outs) -> list:
    """Run `work` (the shared pass), read every session's checks back in one transfer, then
    publish each session that passed them on its own -> each session's outcome. A failure of
    the pass itself (an exception no session's own, device work that did not complete) leaves
    every session unchanged; then each session that did not fail on its own runs its chunk
    alone, so only a session that fails again is reported."""
    results = _shared_pass(txn, work, sessions, outs)
    return [r if r is not None else run_alone(model, s, c, o) for r, s, c, o in zip(results, sessions, chunks, outs)]


def _shared_pass(txn: Transaction, work, sessions, outs) -> list:
    """The pass, validation and publication of `_conclude` -> each session's outcome, None for
    a session that did not fail on its own when the pass itself failed. Every session is
    finished (published or aborted) on the way out."""
    try:
        try:
            work()
        except Exception:
            return [p.failure for p in txn.parts]
        results: list = txn.failures()
        if txn.pass_failed:
            return [p.failure for p in txn.parts]
        try:
            with deferred_signals():        # a signal lands after every session has published
                for j, failure in enumerate(results):
                    results[j] = failure or _publish(txn, j, sessions[j], outs[j])
        except BaseException as exc:
            _attach(exc, results)
            raise
        return results
    finally:
        txn.abort()


def run_alone(model, session, chunk: torch.Tensor, out):
    """One session's chunk as a transaction of its own (the caller holds its lock, in inference
    mode) -> its last logits (`out` or a new tensor) or the `ChunkAborted` that aborted it."""
    try:
        run_chunk(model, session.image, session.budget, chunk.to(model.device), out, session.reserve)
    except ChunkAborted as exc:
        return exc
    return out if out is not None else session.image.read(OUTPUT).clone()


MAX_GRAPHS = 4          # graphs one batch keeps (two while every session publishes)


class BatchSteps:
    """One-token steps of a fixed list of sessions from the static plan (`engine.graphs` does
    the same for one session), captured as CUDA graphs with `capture`. A graph bakes in every
    session's banks and row storage, so one is kept per combination of the sessions' bank
    parities (they flip together while every session publishes: two graphs); storage that grew
    retires them all, as a session's failed step may leave its parity behind (a new combination,
    warmed and captured in its turn)."""

    def __init__(self, model, sessions, capture: bool):
        self.model, self.sessions, self.capture = model, sessions, capture
        self.ids = torch.zeros(len(sessions), dtype=torch.int64, device=model.device)
        self.staged = torch.zeros(len(sessions), dtype=torch.int64, pin_memory=model.device.type == "cuda")
        self.graphs: dict[tuple[int, ...], tuple] = {}
        self.warm: set[tuple[int, ...]] = set()
        self.captures = self.replays = self.uncaptured = 0
        self.refused: str | None = None
        self._tables = self._current_tables()

    def _current_tables(self) -> list[tuple[int, ...]]:
        return [s.image.public.table for s in self.sessions]

    def accepts(self) -> bool:
        return not faults.armed() and all(s.image.room() for s in self.sessions)

    def reservation(self) -> list[int]:
        """Rows to extend each session's storage to when one of them must grow: what the
        neediest would grow to alone (at least the largest storage held), for every session
        within a factor of two of it; a session far shorter keeps its own (and at least its
        `Session(reserve=)`). Sessions of similar lengths then run out of rows together, and
        the graphs are retired once per doubling rather than once per session (each retirement
        costs a few uncaptured steps), without a short session holding a long one's rows."""
        rows = self.model.pool.block_rows
        held = [len(s.image.public.table) * rows for s in self.sessions]
        needs = [max(s.image.public.frontier + 1, 2 * h, rows) for s, h in zip(self.sessions, held)
                 if h <= s.image.public.frontier]
        target = max(held + needs, default=0)
        return [max(s.reserve, target if 2 * (s.image.public.frontier + 1) >= target // 2 else 0)
                for s in self.sessions]

    def retire_stale(self) -> None:
        """Drop the graphs when a session's block table changed (attention in a graph reads the
        rows of the tables it was captured with)."""
        now = self._current_tables()
        if now != self._tables:
            self.graphs.clear()
            self.warm.clear()
        self._tables = now

    def step(self, ids: torch.Tensor, outs) -> list:
        self.retire_stale()
        key = tuple(s.image.public.bank for s in self.sessions)
        held = self.graphs.get(key)
        if held is None and self.capture and self.refused is None and key in self.warm:
            held = self._capture(key)
        if held is None:
            txn = self._transaction()

            def work() -> None:
                self._stage(ids)
                run_stages(self.model, txn, self._step(txn))
                self.uncaptured += 1

            results = _conclude(self.model, txn, work, self.sessions, ids.split(1), outs)
            self.warm.add(key)
            return results
        graph, txn = held

        def replay() -> None:
            txn.restart()                   # a session its budget refuses drops out alone
            self._stage(ids)
            graph.replay()
            txn.completion.record_replay()
            self.replays += 1

        return _conclude(self.model, txn, replay, self.sessions, ids.split(1), outs)

    def _stage(self, ids: torch.Tensor) -> None:
        for s in self.sessions:
            s.image.clean_tails()
            s.image.device_table()
        self.staged.copy_(ids)
        self.ids.copy_(self.staged, non_blocking=True)

    def _step(self, txn: Transaction) -> StepBatch:
        """The step as the plan has it: each session's position its public frontier owner."""
        return StepBatch.tokens(self.ids, [p.public[FRONTIER].view(1) for p in txn.parts])

    def _transaction(self, banks=None) -> Transaction:
        return transaction(self.model, [s.image for s in self.sessions], [s.budget for s in self.sessions],
                           [1] * len(self.sessions), planned=True, banks=banks)

    def _capture(self, key):
        banks = banks_of([s.image.public for s in self.sessions], self.model.device)

        def plan() -> Transaction:
            txn = self._transaction(banks)      # its bank indices made before: no copy inside the capture
            run_stages(self.model, txn, self._step(txn))
            txn.checks.fold()
            return txn

        for s in self.sessions:
            s.image.device_table()              # current before the capture: no copy inside it
        graph, txn, self.refused = capture(plan)
        if graph is None:
            return None
        if any(p.failure is not None for p in txn.parts):      # a seal refused during capture: not a plan to keep
            return None
        self.captures += 1
        while len(self.graphs) >= MAX_GRAPHS:   # parities that went out of step: keep the newest
            del self.graphs[next(iter(self.graphs))]
        self.graphs[key] = (graph, txn)
        return self.graphs[key]


def _publish(txn: Transaction, j: int, session, out):
    try:
        txn.publish(out, j)
    except ChunkAborted as exc:
        return exc
    return out if out is not None else session.image.read(txn.output).clone()


def _attach(exc: BaseException, results: list) -> None:
    try:
        exc.results = results
    except AttributeError:                      # an exception type that takes no attributes
        pass
