"""Several sessions stepped together (`hebrus.feed_many`): the same results as the sessions run
one at a time (fast mode's tolerance), each session its own transaction: one session's NaN or
failed check aborts it alone, bad arguments change nothing."""
from __future__ import annotations

import pytest
import torch

import hebrus
from hebrus.state.pool import Pool
from conftest import poisoned as with_nan_row
from conftest import tokens
from hebrus.engine import batch
from hebrus.faults import PASS_KINDS
from hebrus.errors import DeviceStatusError, InvalidInput, NonFiniteError, StructuralError

# prompt lengths: row logs start at 16 rows, so the 16-token session grows them inside the batch
PROMPTS = (3, 15, 16, 30)
STEPS = 6


@pytest.fixture(scope="module")
def models(fast_models):
    """The fast-mode models of every layer kind, in float32 and (suffix 64) float64."""
    return {**fast_models, **{name + "64": m.with_dtype(torch.float64) for name, m in fast_models.items()}}


def _sessions(model, vocab):
    sessions = [model.session(decode="eager") for _ in PROMPTS]
    for i, (s, n) in enumerate(zip(sessions, PROMPTS)):
        s.feed(tokens(n, seed=i, vocab=vocab))
    return sessions


def _same_state(sessions, others, tolerance):
    for i, (a, b) in enumerate(zip(sessions, others)):
        for spec in a.image.specs:
            _close(a.image.value(spec.name), b.image.value(spec.name), f"session {i}, {spec.name}", tolerance)


def _close(a, b, what, tolerance=2e-5):
    if not a.is_floating_point():
        assert torch.equal(a, b), what
        return
    assert float((a - b).abs().max()) <= tolerance * max(float(b.abs().max()), 1.0), what


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize("bits, tolerance", [(64, 1e-10), (32, 2e-4)])
def test_a_batch_equals_the_sessions_one_at_a_time(models, name, bits, tolerance, one_pass):
    """In float64 a batch is the same arithmetic up to the order of sums (a wrong state or row
    would show as an O(1) error); in float32 these tiny random models amplify rounding, so the
    bound is fast mode's widened one (`docs/decisions.md`)."""
    model = models[name + ("64" if bits == 64 else "")]
    vocab = model.spec.vocab_size
    together, alone = _sessions(model, vocab), _sessions(model, vocab)
    for step in range(STEPS):
        ids = tokens(len(PROMPTS), seed=100 + step, vocab=vocab)
        got = hebrus.feed_many(together, ids)
        want = [s.feed([t]) for s, t in zip(alone, ids)]
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"step {step}, session {i}", tolerance)
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a.frontier == b.frontier == PROMPTS[i] + STEPS
    _same_state(together, alone, tolerance)


@pytest.mark.parametrize("bits, tolerance", [(64, 1e-10), (32, 2e-4)])
def test_several_sessions_chunks_attend_token_by_token_as_each_session_over_its_rows(models, monkeypatch, bits,
                                                                                     tolerance, one_pass):
    """Where the op for lanes reads each lane's rows only up to its position (a kernel on CUDA;
    here its readable twin, so marked), a step of several sessions' chunks attends in one call,
    each token a lane over its session's rows through its table: the same logits and final
    state as each session attending over its own rows (the same arithmetic up to the order of
    sums). A step whose tokens would read more than `LANES_READ` bytes of rows a session on
    average takes the sessions one by one."""
    from hebrus.layers import attention
    from hebrus.ops.qsa import dense_attention_lanes
    model = models["qwen3_5" + ("64" if bits == 64 else "")]
    vocab, calls = model.spec.vocab_size, []

    def lanes(*args, **kwargs):
        calls.append(args[0].shape[0])
        return dense_attention_lanes(*args, **kwargs)

    lanes.reads_to_position = True
    layers = [stage.attn for stage in model.stages if getattr(stage, "attn", None) is not None]
    lengths = (5, 1, 17, 2)
    chunks = [tokens(n, seed=40 + i, vocab=vocab) for i, n in enumerate(lengths)]
    alone = _sessions(model, vocab)
    want = [s.feed(c) for s, c in zip(alone, chunks)]
    together = _sessions(model, vocab)
    for layer in layers:
        monkeypatch.setattr(layer, "attend_lanes", lanes)
    got = hebrus.feed_many(together, chunks)
    assert calls == [sum(lengths)] * len(layers)                  # every token of the step in one call a layer
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"session {i}", tolerance)
    _same_state(together, alone, tolerance)
    k = model.pool.rows[next(iter(model.pool.rows))]
    read = sum(n * (a + len(c)) + n * (n + 1) // 2 for a, c, n in zip(PROMPTS, chunks, lengths))   # rows, now
    monkeypatch.setattr(attention, "LANES_READ", -(-read * 2 * k[0, 0].numel() * k.element_size() // len(lengths)))
    calls.clear()
    hebrus.feed_many(together, chunks)                          # reads exactly the bound: in one call
    assert calls == [sum(lengths)] * len(layers)
    calls.clear()
    hebrus.feed_many(together, chunks)                          # further on, past it: one by one
    assert calls == []


def test_the_blocks_a_pass_of_several_sessions_takes_are_zeroed_together(models, monkeypatch, one_pass):
    """New sessions' first chunks take blocks for every session in one pass: they are zeroed in
    one fill per row storage (each session's alone was a fill per storage each), before any row
    is written into them."""
    model = models["qwen3_5"]
    zeroed, real = [], Pool._zero

    def zero(pool, blocks):
        if getattr(pool._zeroing, "blocks", None) is None and blocks:    # not deferred: a fill now
            zeroed.append(sorted(blocks))
        real(pool, blocks)

    monkeypatch.setattr(Pool, "_zero", zero)
    sessions = [model.session(decode="eager") for _ in range(4)]
    alone = [model.session(decode="eager") for _ in range(4)]
    chunks = [tokens(3 + 5 * i, seed=i, vocab=model.spec.vocab_size) for i in range(4)]
    got = hebrus.feed_many(sessions, chunks)
    assert zeroed == [sorted(b for s in sessions for b in s.image.public.table)]
    for i, (g, s, c) in enumerate(zip(got, alone, chunks)):
        _close(g, s.feed(c), f"session {i}", 2e-4)


def test_one_sessions_nan_aborts_that_session_only(models):
    model = models["qwen3_5"]
    bad, vocab = 5, model.spec.vocab_size
    poisoned = with_nan_row(model, bad)
    sessions = [poisoned.session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.feed([t if t != bad else bad + 1 for t in tokens(8 + i, seed=i, vocab=vocab)])
    before = [s.digest() for s in sessions]
    outs = [torch.full((vocab,), 7.0) for _ in sessions]
    got = hebrus.feed_many(sessions, [1, bad, 2], outs=outs)
    assert isinstance(got[1], NonFiniteError) and sessions[1].digest() == before[1]
    assert torch.equal(outs[1], torch.full((vocab,), 7.0))
    for i in (0, 2):
        assert got[i] is outs[i] and torch.isfinite(outs[i]).all() and sessions[i].digest() != before[i]
    assert torch.isfinite(hebrus.feed_many(sessions, [3, 4, 5])[1]).all()     # and it goes on


def test_one_sessions_failed_check_aborts_that_session_only(models):
    """A token id past the vocabulary that reaches the device (the boundary check bypassed)
    sets session 1's status bit; the others publish."""
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:3]
    before = [s.digest() for s in sessions]
    with torch.inference_mode():
        got = batch.run_step(model, sessions, torch.tensor([1, model.spec.vocab_size + 3, 2]).split(1), [None] * 3)
    assert isinstance(got[1], DeviceStatusError) and "token_range" in str(got[1])
    assert sessions[1].digest() == before[1]
    assert all(isinstance(got[i], torch.Tensor) and sessions[i].digest() != before[i] for i in (0, 2))


def test_a_failure_in_a_shared_stage_aborts_every_session(models, monkeypatch):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:2]
    before = [s.digest() for s in sessions]
    stage = model.stages[3]

    def broken(txn, step):
        raise RuntimeError("boom")

    monkeypatch.setattr(stage, "run", broken)
    got = hebrus.feed_many(sessions, [1, 2])
    assert all(isinstance(g, StructuralError) and g.stage == stage.name for g in got)
    assert [s.digest() for s in sessions] == before


def test_armed_faults_step_the_sessions_one_at_a_time(models):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:2]
    before = sessions[0].digest()
    with hebrus.inject(stage="head", kind="nonfinite"):
        got = hebrus.feed_many(sessions, [1, 2])
    assert isinstance(got[0], NonFiniteError) and sessions[0].digest() == before
    assert isinstance(got[1], torch.Tensor)


def test_bad_batches_are_refused_and_change_nothing(models, tiny):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:2]
    other = models["qwen3_5"].session()
    other.feed([1])
    before = [s.digest() for s in sessions]
    cases = [
        (([], []), "non-empty"),
        (([sessions[0], sessions[0]], [1, 2]), "once"),
        (([sessions[0], other], [1, 2]), "one model"),
        ((sessions, [1]), "one per session"),
        ((sessions, [1, model.spec.vocab_size]), "vocabulary"),
        ((sessions, [[1, 2], []]), "session 1: a chunk holds at least one"),
        ((sessions, [[1, 2], [3, model.spec.vocab_size]]), "session 1: .*vocabulary"),
        ((sessions, [[1, 2], [3], [4]]), "2 chunks, one per session; got 3"),
        ((sessions, [[1, 2], [3] * (model.spec.max_context + 1)]), "session 1: .*context"),
        ((sessions, [1, 2], [None]), "outs"),
        ((sessions, [1, 2], [None, torch.empty(3)]), "shape"),
        ((sessions, [1, 2], [torch.empty(model.spec.vocab_size)] * 2), "overlap"),
        ((sessions, torch.tensor([[1, 2]])), "token ids"),
    ]
    for args, message in cases:
        with pytest.raises(InvalidInput, match=message):
            hebrus.feed_many(*args)
    assert [s.digest() for s in sessions] == before


def test_tokens_may_be_a_tensor_and_outs_a_tuple(models):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:2]
    outs = (torch.empty(model.spec.vocab_size), None)
    got = hebrus.feed_many(sessions, torch.tensor([4, 5]), outs)
    assert got[0] is outs[0] and isinstance(got[1], torch.Tensor)


def test_a_budget_refusal_drops_that_session_alone(models):
    """A session whose budget cannot hold the row storage its next token needs gets the
    AllocationError; the others publish."""
    from hebrus.errors import AllocationError
    model = models["tiny"]
    vocab = model.spec.vocab_size
    starved = model.session()
    starved.feed(tokens(16, vocab=vocab))                    # 16 rows: the next token doubles them
    growth = sum(16 * spec.nbytes for spec in starved.image.appended)
    starved.budget.limit = starved.budget.held + growth - 1  # room for a token's values, not the rows
    fine = _sessions(model, vocab)[:2]
    before = [s.digest() for s in (fine[0], starved, fine[1])]
    got = hebrus.feed_many([fine[0], starved, fine[1]], [1, 2, 3])
    assert isinstance(got[1], AllocationError) and "rows" in str(got[1]) and starved.digest() == before[1]
    assert isinstance(got[0], torch.Tensor) and isinstance(got[2], torch.Tensor)
    assert fine[0].digest() != before[0] and fine[1].digest() != before[2]


def test_with_a_fault_armed_a_full_session_is_refused_before_anything_runs(models, tiny):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:2]
    full = model.session()
    full.prefill(tokens(model.spec.max_context), chunk_size=256)
    before = [s.digest() for s in sessions]
    with hebrus.inject(stage="head", kind="status"):
        with pytest.raises(InvalidInput, match="context limit"):
            hebrus.feed_many([*sessions, full], [1, 2, 3])
    assert [s.digest() for s in sessions] == before


def test_a_signal_during_publication_lands_after_every_session_published(models, monkeypatch):
    import os
    import signal
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:3]
    before = [s.digest() for s in sessions]
    publish, sent = batch._publish, []

    def publish_and_signal(*args):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)
        return publish(*args)

    def late(signum, frame):
        raise RuntimeError("late signal")

    monkeypatch.setattr(batch, "_publish", publish_and_signal)
    previous = signal.signal(signal.SIGUSR1, late)
    try:
        with pytest.raises(RuntimeError, match="late signal") as raised:
            hebrus.feed_many(sessions, [1, 2, 3])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert all(isinstance(r, torch.Tensor) for r in raised.value.results)
    assert all(s.digest() != b for s, b in zip(sessions, before))


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize("bits, tolerance", [(64, 1e-10), (32, 2e-4)])
def test_a_planned_batch_equals_the_eager_one(models, name, bits, tolerance):
    """`Batch` steps from the model's static step plan (captured as CUDA graphs on a GPU; run
    op by op here): lanes' positions, slots, parities and tables as the step's inputs, rows
    written by index, attention over each lane's table masked. Steps that need storage to grow
    take their blocks as they begin, and run from the plan too."""
    model = models[name + ("64" if bits == 64 else "")]
    vocab = model.spec.vocab_size
    planned, eager = _sessions(model, vocab), _sessions(model, vocab)
    group = hebrus.Batch(planned, decode="planned")
    ran = model.steps(capture=False).uncaptured
    for step in range(STEPS):
        ids = tokens(len(PROMPTS), seed=200 + step, vocab=vocab)
        for i, (a, b) in enumerate(zip(group.feed(ids), hebrus.feed_many(eager, ids))):
            _close(a, b, f"step {step}, session {i}", tolerance)
    assert model.steps(capture=False).uncaptured - ran == STEPS
    _same_state(planned, eager, tolerance)


def test_a_planned_batch_isolates_a_nan_and_goes_on(models):
    model = models["qwen3_5"]
    bad, vocab = 5, model.spec.vocab_size
    poisoned = with_nan_row(model, bad)
    sessions, reference = ([poisoned.session() for _ in range(3)] for _ in range(2))
    for group in (sessions, reference):
        for i, s in enumerate(group):
            s.feed([t if t != bad else bad + 1 for t in tokens(6 + i, seed=i, vocab=vocab)])
    planned = hebrus.Batch(sessions, decode="planned")
    before = sessions[1].digest()
    got = planned.feed([1, bad, 2])
    assert isinstance(got[1], NonFiniteError) and sessions[1].digest() == before
    assert sessions[1].image.tail_dirty                         # its NaN rows sit past its frontier
    hebrus.feed_many([reference[0], reference[2]], [1, 2])
    for step_ids in ([3, 4, 6], [7, 8, 9]):           # token 5 is the poisoned one
        for a, b in zip(planned.feed(step_ids), hebrus.feed_many(reference, step_ids)):
            assert torch.isfinite(a).all()
            _close(a, b, "after the NaN", 2e-4)


def test_a_batch_checks_how_it_decodes(models, tiny):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:2]
    with pytest.raises(InvalidInput, match="captures CUDA graphs"):
        hebrus.Batch(sessions, decode="graph")
    with pytest.raises(InvalidInput, match="decode must be one of"):
        hebrus.Batch(sessions, decode="fastest")
    with pytest.raises(InvalidInput, match="fast mode"):
        hebrus.Batch([tiny.session()], decode="planned")
    assert hebrus.Batch([tiny.session()]).decode == "eager"      # exact mode steps eagerly
    assert hebrus.Batch(sessions).decode == "eager"              # auto on the CPU


def test_a_real_allocation_failure_while_one_session_grows_aborts_it_alone(models, monkeypatch):
    from hebrus.errors import AllocationError
    from hebrus.state.txn import Transaction
    model = models["tiny"]
    vocab = model.spec.vocab_size
    sessions = _sessions(model, vocab)
    before = [s.digest() for s in sessions]
    writable = Transaction._writable_table

    def failing(self, part):
        if part.image is sessions[2].image:
            raise torch.OutOfMemoryError("no memory for these rows")
        return writable(self, part)

    monkeypatch.setattr(Transaction, "_writable_table", failing)
    got = hebrus.feed_many(sessions, [1, 2, 3, 4])
    assert isinstance(got[2], AllocationError) and sessions[2].digest() == before[2]
    assert all(isinstance(got[i], torch.Tensor) and sessions[i].digest() != before[i] for i in (0, 1, 3))


def test_outs_may_be_the_rows_of_one_buffer(models):
    model = models["tiny"]
    sessions = _sessions(model, model.spec.vocab_size)[:3]
    buffer = torch.empty(3, model.spec.vocab_size)
    got = hebrus.feed_many(sessions, [1, 2, 3], outs=list(buffer))
    assert all(g.data_ptr() == row.data_ptr() for g, row in zip(got, buffer))


def _capacity(session) -> set[int]:
    return {len(session.image.public.table) * session.model.pool.block_rows}


def test_a_planned_batch_publishes_wherever_feed_many_does(models):
    """At every budget where `feed_many` publishes a session's token, a planned `Batch` whose
    other session must grow publishes it too (growth past what a step needs is asked for last
    and may be refused)."""
    model = models["qwen3_5"]
    vocab = model.spec.vocab_size
    row_bytes = None
    for rows in range(0, 60, 3):
        results = []
        for together in (hebrus.feed_many, "batch"):
            roomy, tight = model.session(decode="eager"), model.session(decode="eager")
            roomy.feed(tokens(16, seed=1, vocab=vocab))
            tight.feed(tokens(3, seed=2, vocab=vocab))
            if row_bytes is None:
                row_bytes = Pool.block_bytes(model.owners, model.pool.block_rows) // model.pool.block_rows
            tight.budget.limit = tight.budget.held + rows * row_bytes
            if together == "batch":
                got = hebrus.Batch([roomy, tight], decode="planned").feed([4, 5])
            else:
                got = together([roomy, tight], [4, 5])
            results.append(isinstance(got[1], torch.Tensor))
        if results[0]:
            assert results[1] == results[0], rows


@pytest.fixture
def one_pass(monkeypatch):
    """Fail the test if a pass fails and its sessions are run alone (which would hide a bug
    behind correct results)."""
    def alone(*args):
        raise AssertionError("the shared pass failed and its sessions were run alone")
    monkeypatch.setattr(batch, "run_alone", alone)


# prompt lengths (a fresh session first, which sees fewer rows than the indexer's top_k), then
# chunk lengths per step, per session: prompts beside decode tokens, logs crossing a block (16 rows)
RAGGED_PROMPTS = (0, 15, 16, 30)
RAGGED = [(2, 1, 17, 1), (1, 9, 1, 2), (3, 1, 1, 20), (1, 1, 1, 1)]


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_ragged_steps_equal_each_session_fed_alone(models, name, mode, one_pass):
    """Sessions' chunks of different lengths in one step (prompts beside decode tokens) publish
    what each session publishes fed the same chunks alone: bit for bit in exact mode (every
    token's arithmetic is its own, whoever shares the step), within float64 rounding of the
    order of sums in fast mode."""
    model = models[name].with_mode("exact") if mode == "exact" else models[name + "64"]
    vocab = model.spec.vocab_size
    together = [model.session(decode="eager") for _ in RAGGED_PROMPTS]
    alone = [model.session(decode="eager") for _ in RAGGED_PROMPTS]
    for i, (a, b, n) in enumerate(zip(together, alone, RAGGED_PROMPTS)):
        if n:
            a.feed(tokens(n, seed=i, vocab=vocab))
            b.feed(tokens(n, seed=i, vocab=vocab))
    for step, lengths in enumerate(RAGGED):
        chunks = [tokens(n, seed=10 * step + i, vocab=vocab) for i, n in enumerate(lengths)]
        got = hebrus.feed_many(together, chunks)
        want = [s.feed(c) for s, c in zip(alone, chunks)]
        for i, (a, b) in enumerate(zip(got, want)):
            assert isinstance(a, torch.Tensor), (step, i, a)
            if mode == "exact":
                assert torch.equal(a, b), f"step {step}, session {i}"
            else:
                _close(a, b, f"step {step}, session {i}", 1e-10)
    for a, b in zip(together, alone):
        assert a.frontier == b.frontier
        if mode == "exact":
            assert a.digest() == b.digest()
    if mode == "fast":
        _same_state(together, alone, 1e-10)


def test_a_ragged_steps_failure_in_one_session_leaves_the_others_published(models, one_pass):
    """A prompt whose token is past the vocabulary (the boundary check bypassed) fails its
    session alone in a step beside decoders and another prompt; the others publish what they
    publish alone."""
    model = models["tiny64"]
    vocab = model.spec.vocab_size
    sessions, alone = _sessions(model, vocab)[:3], _sessions(model, vocab)[:3]
    before = [s.digest() for s in sessions]
    chunks = [torch.tensor([1, 2, 3]), torch.tensor([4, vocab + 3, 5, 6]), torch.tensor([7])]
    with torch.inference_mode():
        got = batch.run_step(model, sessions, chunks, [None] * 3)
    assert isinstance(got[1], DeviceStatusError) and "token_range" in str(got[1])
    assert sessions[1].digest() == before[1]
    for i in (0, 2):
        _close(got[i], alone[i].feed(chunks[i].tolist()), f"session {i}", 1e-10)
        assert sessions[i].digest() != before[i]


@pytest.fixture(scope="module")
def ragged_case(tiny):
    """Three exact-mode sessions (one prefilling, one decoding, one prefilling) and what each
    publishes fed its chunk alone."""
    vocab = tiny.spec.vocab_size
    bases = [tiny.session() for _ in range(3)]
    for i, (s, n) in enumerate(zip(bases, (5, 18, 2))):
        s.feed(tokens(n, seed=40 + i, vocab=vocab))
    chunks = [tokens(4, seed=50, vocab=vocab), tokens(1, seed=51, vocab=vocab), tokens(3, seed=52, vocab=vocab)]
    alone = []
    for s, chunk in zip(bases, chunks):
        copy = s.fork()
        alone.append((copy.feed(chunk), copy.digest()))
    return bases, chunks, alone


@pytest.mark.parametrize("kind", hebrus.FAULT_KINDS)
def test_a_fault_for_one_session_in_a_ragged_step(tiny, ragged_case, kind, request):
    """Every kind at every stage, aimed at one session of a ragged step (in turn a prefilling
    and a decoding one): that session aborts at that stage with that kind and keeps its state;
    the others publish exactly what they publish alone (the pass kinds, structural and command,
    abort the whole pass, and each innocent session then runs alone)."""
    bases, chunks, alone = ragged_case
    if kind not in PASS_KINDS:                  # a session's own failure never fails the pass
        request.getfixturevalue("one_pass")
    for n, stage in enumerate(tiny.stage_names):
        target = n % 2
        sessions = [s.fork() for s in bases]
        before = sessions[target].digest()
        with hebrus.inject(stage=stage, kind=kind, session=sessions[target]):
            got = hebrus.feed_many(sessions, chunks)
        error = got[target]
        assert isinstance(error, hebrus.ChunkAborted), (stage, error)
        assert (error.kind, error.stage) == (kind, stage), (stage, error)
        assert sessions[target].digest() == before, stage
        for i, (logits, digest) in enumerate(alone):
            if i != target:
                assert isinstance(got[i], torch.Tensor) and torch.equal(got[i], logits), (stage, i)
                assert sessions[i].digest() == digest, (stage, i)


def test_a_fault_for_a_session_outside_the_step_does_not_fire(tiny, ragged_case):
    bases, chunks, alone = ragged_case
    sessions, outsider = [s.fork() for s in bases], bases[0].fork()
    with hebrus.inject(stage="head", kind="nonfinite", session=outsider) as fault:
        got = hebrus.feed_many(sessions, chunks)
    assert not fault.fired and all(torch.equal(g, a[0]) for g, a in zip(got, alone))
    with pytest.raises(InvalidInput, match="session must be a hebrus session"):
        with hebrus.inject(stage="head", kind="nonfinite", session="s1"):
            pass
