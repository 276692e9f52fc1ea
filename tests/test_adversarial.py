"""A standing adversarial suite: a stateful machine drives several sessions of one model
through feeds, prefills, generation, every fault kind at every stage, memory-budget refusals,
bad input and Ctrl-C, in any order.

Every session has a shadow that receives only what was published, in the same chunks. After
every step each session must equal its shadow bit for bit (digest and frontier): a failure
changed nothing, a retry equals a run that never failed, and sessions never touch each other.
`out=` buffers must be untouched by every failure. In exact mode the committed tokens fed as
one chunk must also give the same digest.

CI runs a fixed, bounded slice (HEBRUS_HYPOTHESIS=ci); HEBRUS_HYPOTHESIS=long runs far more.
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hebrus
from hebrus.state.image import Image

LONG = os.environ.get("HEBRUS_HYPOTHESIS") == "long"
STEPS = 40 if LONG else 24
EXAMPLES = 120 if LONG else 40
CONTEXT = 48
SENTINEL = -31.0

_base = hebrus.load("tiny")
MODELS = {
    mode: hebrus.Model(_base.config.replace(max_context=CONTEXT), dict(_base.named_parameters()), mode=mode)
    for mode in ("exact", "fast")
}
STAGES = MODELS["exact"].stage_names
V = _base.config.vocab_size

ids = st.lists(st.integers(0, V - 1), min_size=1, max_size=12)
bad_ids = st.one_of(
    st.just([]), st.lists(st.integers(V, 2**40), min_size=1, max_size=3),
    st.lists(st.integers(-(2**40), -1), min_size=1, max_size=3), st.just([1.5]), st.just("text"),
    st.just(torch.zeros(2, 2, dtype=torch.int64)), st.just(torch.tensor([0.5])),
)


@contextmanager
def _stage_raises(model, stage_name: str, exc: BaseException):
    stage = next(s for s in model.stages if s.name == stage_name)
    real = stage.run

    def failing(txn, step):
        real(txn, step)
        raise exc

    stage.run = failing
    try:
        yield
    finally:
        del stage.run                      # back to the class's method


@contextmanager
def _sigint_during_publication():
    real = Image.publish

    def interrupted(self, record):
        signal.raise_signal(signal.SIGINT)
        real(self, record)

    Image.publish = interrupted
    try:
        yield
    finally:
        Image.publish = real


class Sessions(RuleBasedStateMachine):
    """Sessions 0 and 1 are unlimited; session 2 has a memory budget that refuses growth of
    its row storage past 16 rows."""

    @initialize(mode=st.sampled_from(["exact", "fast"]))
    def start(self, mode):
        self.model = MODELS[mode]
        probe = self.model.session()
        probe.feed([1] * 7)
        budget = probe.budget.held + 20_000
        self.sessions = [self.model.session(), self.model.session(), self.model.session(memory_budget=budget)]
        self.shadows = [self.model.session() for _ in self.sessions]
        self.committed = [[] for _ in self.sessions]

    # ---- helpers ---------------------------------------------------------------------------
    def _pick(self, index):
        i = index % len(self.sessions)
        return i, self.sessions[i]

    def _commit(self, i, tokens, chunk_size=None):
        if not tokens:
            return
        shadow = self.shadows[i]
        shadow.prefill(tokens, chunk_size) if chunk_size else shadow.feed(tokens)
        self.committed[i] += list(tokens)

    def _room(self, i):
        return CONTEXT - self.sessions[i].frontier

    def _expect_unchanged(self, s, before, frontier, out):
        assert s.digest() == before and s.frontier == frontier
        assert out is None or bool((out == SENTINEL).all())

    # ---- rules -----------------------------------------------------------------------------
    @rule(index=st.integers(0, 2), chunk=ids, with_out=st.booleans())
    def feed(self, index, chunk, with_out):
        i, s = self._pick(index)
        out = torch.full((V,), SENTINEL) if with_out else None
        before, frontier = s.digest(), s.frontier
        try:
            logits = s.feed(chunk, out=out)
        except hebrus.InvalidInput:
            assert len(chunk) > self._room(i)
            return self._expect_unchanged(s, before, frontier, out)
        except hebrus.AllocationError:
            assert i == 2, "only the budgeted session may be refused"
            return self._expect_unchanged(s, before, frontier, out)
        assert len(chunk) <= CONTEXT - frontier
        self._commit(i, chunk)
        assert torch.equal(logits, self.shadows[i].logits)
        assert out is None or logits is out

    @rule(index=st.integers(0, 2), chunk=bad_ids)
    def feed_bad_input(self, index, chunk):
        _, s = self._pick(index)
        before, frontier = s.digest(), s.frontier
        with pytest.raises(hebrus.InvalidInput):
            s.feed(chunk)
        self._expect_unchanged(s, before, frontier, None)

    @rule(index=st.integers(0, 2), chunk=ids, stage=st.sampled_from(STAGES),
          kind=st.sampled_from(hebrus.FAULT_KINDS))
    def feed_with_fault(self, index, chunk, stage, kind):
        i, s = self._pick(index)
        out = torch.full((V,), SENTINEL)
        before, frontier = s.digest(), s.frontier
        try:
            with hebrus.inject(stage=stage, kind=kind):
                s.feed(chunk, out=out)
        except hebrus.InvalidInput:
            assert len(chunk) > self._room(i)
        except hebrus.ChunkAborted as err:
            assert i == 2 or (err.kind, err.stage) == (kind, stage)
        else:
            raise AssertionError("an armed fault did not fail the chunk")
        self._expect_unchanged(s, before, frontier, out)

    @rule(index=st.integers(0, 2), tokens=st.lists(st.integers(0, V - 1), min_size=1, max_size=30),
          chunk_size=st.integers(1, 9), fault=st.none() | st.tuples(st.sampled_from(STAGES),
                                                                      st.sampled_from(hebrus.FAULT_KINDS)))
    def prefill(self, index, tokens, chunk_size, fault):
        i, s = self._pick(index)
        armed = hebrus.inject(stage=fault[0], kind=fault[1]) if fault else _nothing()
        try:
            with armed:
                s.prefill(tokens, chunk_size=chunk_size)
        except hebrus.InvalidInput:
            assert len(tokens) > self._room(i)
            return
        except hebrus.ChunkAborted as err:
            assert fault is not None or i == 2
            assert err.published % chunk_size == 0
            return self._commit(i, tokens[:err.published], chunk_size)
        assert fault is None
        self._commit(i, tokens, chunk_size)

    @rule(index=st.integers(0, 2), prompt=st.lists(st.integers(0, V - 1), max_size=6),
          steps=st.integers(0, 5), temperature=st.sampled_from([0.0, 0.7, 1e-300]), seed=st.integers(0, 3),
          fault=st.none() | st.sampled_from(STAGES))
    def generate(self, index, prompt, steps, temperature, seed, fault):
        i, s = self._pick(index)
        if not prompt and s.frontier == 0:
            prompt = [1]
        yielded = []
        armed = hebrus.inject(stage=fault, kind="nonfinite") if fault else _nothing()
        try:
            with armed:
                for token in s.generate(prompt, max_new_tokens=steps, temperature=temperature, seed=seed,
                                        chunk_size=4):
                    yielded.append(token)
        except hebrus.InvalidInput:
            assert len(prompt) + steps > self._room(i)
            return
        except hebrus.ChunkAborted as err:
            assert fault is not None or i == 2
            if s.frontier - len(self.committed[i]) < len(prompt):     # failed inside the prompt
                return self._commit(i, prompt[:err.published], 4)
        self._commit(i, prompt, 4)
        for token in yielded:
            self._commit(i, [token])

    @rule(index=st.integers(0, 2), chunk=ids, stage=st.sampled_from(STAGES))
    def ctrl_c_inside_a_stage(self, index, chunk, stage):
        i, s = self._pick(index)
        out = torch.full((V,), SENTINEL)
        before, frontier = s.digest(), s.frontier
        with _stage_raises(self.model, stage, KeyboardInterrupt()):
            with pytest.raises((KeyboardInterrupt, hebrus.InvalidInput, hebrus.AllocationError)):
                s.feed(chunk, out=out)
        self._expect_unchanged(s, before, frontier, out)

    @precondition(lambda self: self.sessions[0].frontier < CONTEXT - 3)
    @rule(chunk=st.lists(st.integers(0, V - 1), min_size=1, max_size=3))
    def ctrl_c_during_publication(self, chunk):
        s = self.sessions[0]
        out = torch.full((V,), SENTINEL)
        with _sigint_during_publication(), pytest.raises(KeyboardInterrupt):
            s.feed(chunk, out=out)
        self._commit(0, chunk)
        assert torch.equal(out, self.shadows[0].logits), "out and the published state disagree"

    @rule(index=st.integers(0, 2), chunk=ids, stage=st.sampled_from(STAGES))
    def real_exception_inside_a_stage(self, index, chunk, stage):
        i, s = self._pick(index)
        before, frontier = s.digest(), s.frontier
        with _stage_raises(self.model, stage, RuntimeError("boom")):
            try:
                s.feed(chunk)
            except hebrus.InvalidInput:
                pass
            except hebrus.ChunkAborted as err:
                assert i == 2 or (err.kind, err.stage) == ("structural", stage)
            else:
                raise AssertionError("the exception did not abort the chunk")
        self._expect_unchanged(s, before, frontier, None)

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def each_session_equals_its_shadow(self):
        if not hasattr(self, "sessions"):
            return
        for s, shadow in zip(self.sessions, self.shadows):
            assert s.frontier == shadow.frontier
            assert s.digest() == shadow.digest()

    def teardown(self):
        if not hasattr(self, "sessions") or self.model.mode != "exact":
            return
        for s, tokens in zip(self.sessions, self.committed):
            if tokens:
                ref = self.model.session()
                ref.feed(tokens)
                assert s.digest() == ref.digest(), "exact mode: the committed tokens in one chunk differ"


@contextmanager
def _nothing():
    yield


Sessions.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_sessions = Sessions.TestCase
