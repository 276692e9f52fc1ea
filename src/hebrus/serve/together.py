"""How the server's decoding requests step together: one `Batch` of their sessions.

Without graphs (the CPU, exact work op by op) a `Batch` costs nothing to make, so it is made
again whenever a request joins or leaves.

With CUDA graphs a new `Batch` costs two slow steps (one from the plan, op by op, then the
capture), each about as long as an eager step of every session in it, and then replays fast
for as long as the same sessions step together. So a request that ends (finished, failed,
cancelled) stays in the batch as a ghost: its session is stepped with a dummy token and the
result dropped, and the graphs stay valid; its conversation, if kept, is a copy made when it
ended (`Session.fork(copy_rows=True)`). The batch is made again, of the live requests only,
when one joins, when ghosts are half of it, or when a ghost could no longer step in place.
(Cohorts of their own for newcomers, merged as they grew, were measured on the H200 and lost:
every merge costs two slow steps of the merged size.)
"""
from __future__ import annotations

import collections
import time

from hebrus.batching import Batch

GHOST_TOKEN = 0                 # what a ghost is fed: any id will do, its results are dropped


class Together:
    def __init__(self, model, graphs: bool):
        self.model, self.graphs = model, graphs
        self.members: list = []         # requests in the batch's order; ended ones are ghosts
        self.batch: Batch | None = None
        self.widest = 0                 # the most sessions one pass has stepped (tests, bench)
        self.made = 0                   # batches made so far
        self._replayed = 0              # graph replays of batches no longer in use
        # steps and their seconds, replayed from graphs or not (bench): "replayed", "replayed_s",
        # "slow", "slow_s"
        self.timed: collections.Counter[str] = collections.Counter()

    def holds(self, request) -> bool:
        """Whether `request`'s session is in the batch (it goes on being stepped as a ghost)."""
        return any(request is r for r in self.members)

    def step(self, requests: list, tokens: dict) -> dict:
        """One step of each of `requests` (every request decoding together this turn), request
        id -> its logits or the `ChunkAborted` that aborted it. Anything else raised leaves no
        batch behind, and no request stepped (the caller steps them alone)."""
        live = {r.id for r in requests}
        try:
            if self._stale(requests):
                self.let_go()
                self.batch, self.members = Batch([r.session for r in requests]), list(requests)
                self.made += 1
            ids = [tokens[r.id] if r.id in live else GHOST_TOKEN for r in self.members]
            self.widest = max(self.widest, len(ids))
            replays, started = self.replays, time.perf_counter()
            step = self.batch.feed(ids)
            kind = "replayed" if self.replays > replays else "slow"
            self.timed[kind] += 1
            self.timed[kind + "_s"] += time.perf_counter() - started
        except Exception:
            self.let_go()
            raise
        return {r.id: result for r, result in zip(self.members, step) if r.id in live}

    def let_go(self) -> None:
        """Drop the batch: its graphs, and the sessions they hold, go with it."""
        self._replayed = self.replays
        self.batch, self.members = None, []

    @property
    def replays(self) -> int:
        """Steps run from CUDA graphs so far."""
        steps = self.batch._steps if self.batch is not None else None
        return self._replayed + (steps.replays if steps is not None else 0)

    def _stale(self, requests: list) -> bool:
        """Whether the batch must be made again for these requests."""
        if self.batch is None:
            return True
        if not self.graphs:
            return [r.id for r in self.members] != [r.id for r in requests]
        held = {r.id for r in self.members}
        if any(r.id not in held for r in requests):         # one joins
            return True
        live = {r.id for r in requests}
        ghosts = [r for r in self.members if r.id not in live]
        return 2 * len(ghosts) >= len(self.members) or not all(self._can_idle(r) for r in ghosts)

    def _can_idle(self, request) -> bool:
        """Whether `request`, not stepping with the others this turn, can be a ghost: it has
        ended (one still running steps alone, and must not be stepped twice), and its session
        takes a step in place (a row of its storage free, its context not full)."""
        session = request.session
        return request.ended and session.image.room() and session.frontier < self.model.spec.max_context
