"""How the server's decoding requests step together: `Batch`es of their sessions.

Without graphs (the CPU, or planned steps) a `Batch` costs nothing to make, so there is one, of
every decoding request, made again whenever one joins or leaves.

With CUDA graphs a new `Batch` costs two slow steps (one from the plan, op by op, then the
capture) whose time grows with its size, and then replays fast for as long as the same sessions
step together. So the requests are kept in cohorts, each a `Batch` of its own:

- the requests that start decoding in one turn form a new cohort;
- a request that ends (finished, failed, cancelled) stays in its cohort as a ghost: its session
  is stepped with a dummy token and the result dropped, so the cohort's graphs stay valid; its
  conversation, if kept, is a copy made when it ended (`Session.fork(copy_rows=True)`);
- a cohort whose ghosts are half of it or more, or one of whose ghosts could no longer step
  in place, is made again from its live requests only;
- the newest cohort is merged into the one before it while it is at least half that one's
  size, so sizes halve from the oldest to the newest and there are about log2(requests) of
  them: a request is re-made O(log n) times over its life, and a turn replays a few graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hebrus.batching import Batch

GHOST_TOKEN = 0                 # what a ghost is fed: any id will do, its results are dropped


@dataclass
class Cohort:
    members: list                       # requests, in the batch's order; ended ones are ghosts
    batch: Batch = field(init=False)

    def __post_init__(self):
        self.batch = Batch([r.session for r in self.members])

    @property
    def replays(self) -> int:
        steps = self.batch._steps
        return steps.replays if steps is not None else 0


class Together:
    def __init__(self, model, graphs: bool):
        self.model, self.graphs = model, graphs
        self.cohorts: list[Cohort] = []
        self.widest = 0                 # the most sessions one pass has stepped (tests, bench)
        self.made = 0                   # batches made so far
        self._replayed = 0              # graph replays of cohorts no longer in use

    def holds(self, request) -> bool:
        """Whether `request`'s session is in a cohort (it goes on being stepped as a ghost)."""
        return any(request in c.members for c in self.cohorts)

    def step(self, requests: list, tokens: dict) -> dict:
        """One step of each of `requests` (every request decoding together this turn), request
        id -> its logits or the `ChunkAborted` that aborted it. Anything else raised leaves no
        cohort behind (the caller steps the requests alone)."""
        try:
            self._arrange(requests)
            results = {}
            live = {r.id for r in requests}
            for cohort in self.cohorts:
                ids = [tokens[r.id] if r.id in live else GHOST_TOKEN for r in cohort.members]
                self.widest = max(self.widest, len(ids))
                for request, result in zip(cohort.members, cohort.batch.feed(ids)):
                    if request.id in live:
                        results[request.id] = result
            return results
        except Exception:
            self.let_go()
            raise

    def let_go(self) -> None:
        """Drop every cohort: their graphs, and the sessions they hold, go with them."""
        self._replayed = self.replays
        self.cohorts = []

    @property
    def replays(self) -> int:
        """Steps of a cohort run from CUDA graphs so far."""
        return self._replayed + sum(c.replays for c in self.cohorts)

    def _arrange(self, requests: list) -> None:
        live = {r.id for r in requests}
        if not self.graphs:
            if not self.cohorts or [r.id for r in self.cohorts[0].members] != [r.id for r in requests]:
                self._remake([requests])
            return
        kept, placed = [], set()
        for cohort in self.cohorts:
            members = [r for r in cohort.members if r.id in live]
            placed.update(r.id for r in members)
            ghosts = [r for r in cohort.members if r.id not in live]
            if members and 2 * len(ghosts) < len(cohort.members) and all(self._can_idle(r) for r in ghosts):
                kept.append(cohort)
                continue
            self._replayed += cohort.replays
            if members:
                kept.append(self._make(members))
        new = [r for r in requests if r.id not in placed]
        if new:
            kept.append(self._make(new))
        while len(kept) > 1 and 2 * len(kept[-1].members) >= len(kept[-2].members):
            newer, older = kept.pop(), kept.pop()
            self._replayed += newer.replays + older.replays
            kept.append(self._make([r for r in older.members + newer.members if r.id in live]))
        self.cohorts = kept

    def _can_idle(self, request) -> bool:
        """Whether `request`, not stepping with the others this turn, can be a ghost: it has
        ended (one still running steps alone, and must not be stepped twice), and its session
        takes a step in place (a row of its storage free, its context not full)."""
        session = request.session
        return request.ended and session.image.room() and session.frontier < self.model.spec.max_context

    def _remake(self, groups: list[list]) -> None:
        self._replayed = self.replays
        self.cohorts = [self._make(g) for g in groups]

    def _make(self, members: list) -> Cohort:
        self.made += 1
        return Cohort(list(members))
