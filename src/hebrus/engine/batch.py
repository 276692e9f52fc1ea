"""Several sessions stepped together: one token each, one pass through the stages, one
transaction per session (`state.batch`). The stages run once for all of them, so the weights
are read once for B tokens; each session is then validated (all their checks come back in one
transfer) and published on its own, so a NaN or a failed check in one session's rows aborts
that session only; so does a refusal of its row storage's growth or of its share of the
intermediates (its memory budget sees what it would see alone). Any other exception in the
shared pass cannot be pinned on one session and aborts them all.
"""
from __future__ import annotations

import torch

from hebrus import faults
from hebrus.engine.eager import run_stages, transaction
from hebrus.engine.graphs import capture
from hebrus.errors import AllocationError, ChunkAborted, CommandError
from hebrus.layers.owners import FRONTIER
from hebrus.state.batch import BatchTransaction
from hebrus.state.step import StepBatch
from hebrus.state.budget import out_of_memory
from hebrus.state.interrupts import deferred_signals
from hebrus.state.txn import Transaction, abort_error


def _read_together(parts: list[Transaction]) -> list[list[float]]:
    """Every session's folded checks in one device-to-host transfer, split back per session."""
    folded = [p.checks.fold() for p in parts]
    present = [f for f in folded if f is not None]
    flat = torch.cat(present).tolist() if present else []
    out, at = [], 0
    for f in folded:
        n = 0 if f is None else f.numel()
        out.append(flat[at:at + n])
        at += n
    return out


def run_tokens(model, sessions, ids: torch.Tensor, outs, reserve: list[int] | None = None) -> list:
    """ids [B]: token i for session i (the caller holds every session's lock, in inference mode).
    Returns, per session, its logits (`outs[i]` or a new tensor) or the `ChunkAborted` that
    aborted it. `reserve[i]`: rows session i's storage is extended to after the pass, if granted
    (see `Transaction.extend_reserved`)."""
    reserve = reserve or [s.reserve for s in sessions]
    parts = [transaction(model, s.image, s.budget, 1, reserve=r) for s, r in zip(sessions, reserve)]
    batch = BatchTransaction(parts, model.device)

    def work() -> None:             # no fault is armed here: its injection points do nothing
        run_stages(model, batch, StepBatch.tokens(ids.to(model.device), [p.frontier for p in parts]))
        for j, part in enumerate(batch.parts):
            if j not in batch.failed:
                part.extend_reserved()

    return _conclude(batch, work, sessions, outs)


def _conclude(batch: BatchTransaction, work, sessions, outs) -> list:
    """Run `work` (the shared pass), read every session's checks back in one transfer, then
    validate and publish each session on its own -> each session's outcome. Every part is
    finished (published or aborted) on the way out."""
    try:
        try:
            work()
        except ChunkAborted as exc:
            return [exc] * len(sessions)
        except Exception as exc:
            return [abort_error(batch.stage, exc)] * len(sessions)
        try:
            values = _read_together(batch.parts)
        except Exception as exc:            # the one transfer failed: no session can be validated
            error = (AllocationError if out_of_memory(exc) else CommandError)(
                "validate", f"device work failed: {type(exc).__name__}: {exc}")
            return [error] * len(sessions)
        results: list = [None] * len(sessions)
        try:
            with deferred_signals():        # a signal lands after every session has published
                for j, part in enumerate(batch.parts):
                    results[j] = batch.failed.get(j) or _publish(part, sessions[j], values[j], outs[j])
        except BaseException as exc:
            _attach(exc, results)
            raise
        return results
    finally:
        for part in batch.parts:
            part.abort()


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
            batch = self._batch()

            def work() -> None:
                self._stage(ids)
                run_stages(self.model, batch, self._step(batch))
                self.uncaptured += 1

            results = _conclude(batch, work, self.sessions, outs)
            self.warm.add(key)
            return results
        graph, batch = held

        def replay() -> None:
            batch.stage = self.model.stage_names[0]    # a replay's own failures: a graph cannot say which stage
            for j, part in enumerate(batch.parts):
                try:
                    part.restart()
                except ChunkAborted as exc:     # this session's budget: it drops out alone
                    batch.failed[j] = exc
            self._stage(ids)
            graph.replay()
            for part in batch.parts:
                part.completion.record_replay()
            self.replays += 1

        batch.failed.clear()
        return _conclude(batch, replay, self.sessions, outs)

    def _stage(self, ids: torch.Tensor) -> None:
        for s in self.sessions:
            s.image.clean_tails()
            s.image.device_table()
        self.staged.copy_(ids)
        self.ids.copy_(self.staged, non_blocking=True)

    def _step(self, batch: BatchTransaction) -> StepBatch:
        """The step as the plan has it: each session's position its public frontier owner."""
        return StepBatch.tokens(self.ids, [part.public[FRONTIER].view(1) for part in batch.parts])

    def _batch(self, banks=None) -> BatchTransaction:
        parts = [transaction(self.model, s.image, s.budget, 1, planned=True) for s in self.sessions]
        return BatchTransaction(parts, self.model.device, banks)

    def _capture(self, key):
        banks = BatchTransaction.banks_of([s.image.public for s in self.sessions], self.model.device)

        def plan() -> BatchTransaction:
            batch = self._batch(banks)          # its bank indices made before: no copy inside the capture
            run_stages(self.model, batch, self._step(batch))
            for part in batch.parts:
                part.checks.fold()
            return batch

        for s in self.sessions:
            s.image.device_table()              # current before the capture: no copy inside it
        graph, batch, self.refused = capture(plan)
        if graph is None:
            return None
        if batch.failed:                        # a seal refused during capture: not a plan to keep
            return None
        self.captures += 1
        while len(self.graphs) >= MAX_GRAPHS:   # parities that went out of step: keep the newest
            del self.graphs[next(iter(self.graphs))]
        self.graphs[key] = (graph, batch)
        return self.graphs[key]


def _publish(part: Transaction, session, values: list[float], out):
    try:
        try:
            part.validate(values)
        except ChunkAborted:
            raise
        except Exception as exc:
            raise abort_error(part.stage, exc) from exc
        part.publish(out)
    except ChunkAborted as exc:
        return exc
    return out if out is not None else session.image.read(part.output).clone()


def _attach(exc: BaseException, results: list) -> None:
    try:
        exc.results = results
    except AttributeError:                      # an exception type that takes no attributes
        pass
