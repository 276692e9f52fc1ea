"""Sessions in one small state pool (`state/pool.py`): a stateful hypothesis run opens sessions,
feeds them chunks, forks them (forks share blocks), aborts their chunks with every fault kind,
runs them out of slots and blocks, and lets them go, in any order.

After every step each live session holds exactly the state it would hold alone: its digest
equals that of a session of a second model (same weights, a pool of its own) fed the tokens it
published, in exact mode bit for bit. A refusal (no slot, no block) is an AllocationError that
changes nothing. And the pool never leaks: free slots + live sessions = all slots, free blocks +
held blocks = all blocks, and each block is held exactly as many times as live tables name it.
Sessions that fed `hebrus.feed_many` (fast mode) are checked by `test_batch`; this run is about
the layout. CI runs a fixed slice; HEBRUS_HYPOTHESIS=long runs far more.
"""
from __future__ import annotations

import gc
import os
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hebrus
from hebrus.state.pool import Pool

LONG = os.environ.get("HEBRUS_HYPOTHESIS") == "long"
SLOTS, BLOCKS = 4, 7

_base = hebrus.load("tiny")
REFERENCE = hebrus.Model(_base.config.replace(max_context=96), dict(_base.named_parameters()), mode="exact")
STAGES = REFERENCE.stage_names
V = _base.config.vocab_size
ids = st.lists(st.integers(0, V - 1), min_size=1, max_size=20)
_alone: dict[tuple[int, ...], str] = {}


def alone(tokens: tuple[int, ...]) -> str:
    """The digest of a session of the reference model fed `tokens` (one chunk, exact mode)."""
    if tokens not in _alone:
        s = REFERENCE.session()
        if tokens:
            s.feed(list(tokens))
        _alone[tokens] = s.digest()
    return _alone[tokens]


class PooledSessions(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = hebrus.Model(REFERENCE.config, dict(_base.named_parameters()), mode="exact")
        self.model._pool = Pool(self.model.owners, self.model.device, SLOTS, BLOCKS, 16, REFERENCE.spec.max_context)
        self.live: list[tuple[object, tuple[int, ...]]] = []       # (session, the tokens it published)

    def _room(self, i: int) -> int:
        return REFERENCE.spec.max_context - len(self.live[i][1])

    @rule()
    def join(self):
        try:
            self.live.append((self.model.session(), ()))
        except hebrus.AllocationError as exc:
            assert len(self.live) == SLOTS and "slots" in str(exc)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=ids)
    def feed(self, data, chunk):
        i = data.draw(st.integers(0, len(self.live) - 1))
        session, tokens = self.live[i]
        chunk = chunk[:self._room(i)]
        if not chunk:
            return
        try:
            session.feed(chunk)
        except hebrus.AllocationError as exc:                  # no block free: nothing changed
            assert "blocks" in str(exc) and session.digest() == alone(tokens)
            return
        self.live[i] = (session, tokens + tuple(chunk))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=ids, stage=st.sampled_from(STAGES), kind=st.sampled_from(hebrus.FAULT_KINDS))
    def abort(self, data, chunk, stage, kind):
        i = data.draw(st.integers(0, len(self.live) - 1))
        session, tokens = self.live[i]
        chunk = chunk[:self._room(i)]
        if not chunk:
            return
        with hebrus.inject(stage=stage, kind=kind):
            with pytest.raises(hebrus.ChunkAborted):
                session.feed(chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.live) - 1))
        session, tokens = self.live[i]
        copy_rows = data.draw(st.booleans())
        try:
            self.live.append((session.fork(copy_rows=copy_rows), tokens))
        except hebrus.AllocationError as exc:
            assert len(self.live) == SLOTS or copy_rows, exc

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def leave(self, data):
        del self.live[data.draw(st.integers(0, len(self.live) - 1))]

    @invariant()
    def each_session_is_as_alone(self):
        for session, tokens in self.live:
            assert session.frontier == len(tokens) and session.digest() == alone(tokens)

    @invariant()
    def the_pool_never_leaks(self):
        gc.collect()                        # a session let go gives its slot and blocks back when collected
        pool = self.model.pool
        assert pool.free_slots + len(self.live) == pool.slots
        held = pool.held()
        assert pool.free_blocks + len(held) == pool.blocks
        named = Counter(block for session, _ in self.live for block in session.image.public.table)
        assert held == dict(named)


PooledSessions.TestCase.settings = settings(
    max_examples=200 if LONG else 12, stateful_step_count=30 if LONG else 16, deadline=None,
    derandomize=not LONG, suppress_health_check=list(HealthCheck))
test_pooled_sessions = PooledSessions.TestCase
