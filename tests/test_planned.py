"""One-token steps from the static step plan (the work a CUDA graph captures), run uncaptured on
the CPU against the eager runner: same logits and state within fast mode's tolerance, the same
discrete choices, storage growth between plans, and failures that publish nothing."""
from __future__ import annotations

import pytest
import torch
from conftest import poisoned as with_nan_row
from conftest import tokens

import hebrus
from hebrus.errors import DeviceStatusError, InvalidInput, NonFiniteError

STEPS = 24


@pytest.fixture(scope="module")
def models(fast_models):
    return fast_models


def _state(session) -> dict[str, torch.Tensor]:
    image = session.image
    return {spec.name: image.value(spec.name).clone() for spec in image.specs}


def _decode(model, decode, prompt, steps, vocab):
    s = model.session(decode=decode)
    s.feed(prompt)
    ids = tokens(steps, seed=7, vocab=vocab)
    return s, [s.feed([t]) for t in ids]


def _pairs(model, lengths: list[int]):
    """A planned and an eager session for each length, each pair fed the same prompt."""
    planned = [model.session(decode="planned") for _ in lengths]
    eager = [model.session(decode="eager") for _ in lengths]
    for i, (p, e, n) in enumerate(zip(planned, eager, lengths)):
        prompt = tokens(n, seed=i, vocab=model.spec.vocab_size)
        p.feed(prompt)
        e.feed(prompt)
    return planned, eager


def _close(a, b, name, tolerance=2e-5):
    if not a.is_floating_point():
        assert torch.equal(a, b), name
        return
    scale = max(float(b.abs().max()), 1.0)
    assert float((a - b).abs().max()) <= tolerance * scale, name


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe"])
def test_planned_steps_match_eager(models, name):
    model = models[name]
    vocab = model.spec.vocab_size
    prompt = tokens(10, seed=3, vocab=vocab)     # row logs hold 16 rows: the steps grow them twice
    runner = model.steps(capture=False)
    ran = runner.uncaptured
    planned, got = _decode(model, "planned", prompt, STEPS, vocab)
    eager, want = _decode(model, "eager", prompt, STEPS, vocab)
    for step, (a, b) in enumerate(zip(got, want)):
        _close(a, b, f"logits of step {step}")
    assert planned.frontier == eager.frontier == len(prompt) + STEPS
    # rows 16 and 32 needed storage to grow: blocks taken as each step began, every step from the plan
    assert runner.uncaptured - ran == STEPS
    a, b = _state(planned), _state(eager)
    for owner in b:
        _close(a[owner], b[owner], owner)
    if "moe" in model.spec.ffns:
        assert torch.equal(planned.image.rows("routes"), eager.image.rows("routes"))


def test_planned_steps_over_a_scattered_table_match_eager(models):
    """Two planned sessions growing in turn take blocks between each other's, so their tables
    are not runs of consecutive blocks: the plan gathers their rows through the table (not one
    view of the storage), and still steps as the eager runner does."""
    from hebrus.state.pool import first_of_run
    model = models["tiny"].with_kv_cache(None)      # a pool of its own: the same blocks taken on any run
    vocab = model.spec.vocab_size
    pair = [model.session(decode="planned") for _ in range(2)]
    eager = [model.session(decode="eager") for _ in range(2)]
    ran = model.steps(capture=False).uncaptured
    for step in range(40):
        for i in range(2):
            token = tokens(1, seed=100 * i + step, vocab=vocab)
            _close(pair[i].feed(token), eager[i].feed(token), f"session {i}, step {step}")
    assert any(first_of_run(s.image.public.table) is None for s in pair)
    assert model.steps(capture=False).uncaptured - ran == 80       # every step ran from the plan
    for s, e in zip(pair, eager):
        a, b = _state(s), _state(e)
        for owner in b:
            _close(a[owner], b[owner], owner)


def test_a_nan_step_publishes_nothing_and_the_next_step_is_clean(models):
    """A real NaN (a token whose embedding row is NaN) aborts the planned step; its K/V rows
    past the frontier are wiped before the next step attends over the whole storage."""
    model = models["qwen3_5"]
    bad = 5
    poisoned = with_nan_row(model, bad)
    prompt = tokens(10, seed=3, vocab=model.spec.vocab_size - 1)
    prompt = [t if t != bad else bad + 1 for t in prompt]
    s = poisoned.session(decode="planned")
    s.feed(prompt)
    before, out = s.digest(), torch.full((model.spec.vocab_size,), 7.0)
    with pytest.raises(NonFiniteError):
        s.feed([bad], out=out)
    assert s.digest() == before and torch.equal(out, torch.full_like(out, 7.0))
    assert s.image.tail_dirty
    after = s.feed([bad + 1])
    ref = poisoned.session(decode="eager")
    ref.feed(prompt)
    _close(after, ref.feed([bad + 1]), "logits after the aborted step")
    assert torch.isfinite(after).all()


def test_a_device_range_failure_publishes_nothing(models):
    """A token id past the vocabulary that reaches the device (the boundary check bypassed)
    sets the status bit inside the planned step; nothing is published."""
    model = models["tiny"]
    s = model.session(decode="planned")
    s.feed(tokens(4))
    before = s.digest()
    with pytest.raises(DeviceStatusError, match="token_range"):
        with torch.inference_mode():
            s._run(torch.tensor([model.spec.vocab_size + 3]), None)
    assert s.digest() == before
    s.feed([1])                                     # and the session goes on


def test_decode_is_checked(tiny, models):
    with pytest.raises(InvalidInput, match="decode must be one of"):
        models["tiny"].session(decode="fastest")
    with pytest.raises(InvalidInput, match="runs exact mode"):
        tiny.session(decode="planned")
    with pytest.raises(InvalidInput, match="captures CUDA graphs"):
        models["tiny"].session(decode="graph")
    assert models["tiny"].session().decode == "eager"          # auto on the CPU


def test_a_replay_refused_by_one_sessions_budget_fails_that_session_alone(models):
    """Two sessions replay a captured step; one's budget refuses the captured peak, asked once
    the replay is launched: that session fails with an allocation error and publishes nothing,
    the other is untouched by it."""
    from hebrus.errors import AllocationError
    model = models["tiny"]
    runner = model.steps(capture=False)
    a, b = (model.session(decode="planned") for _ in range(2))
    for s in (a, b):
        s.feed(tokens(5))
    together = hebrus.Batch([a, b], decode="planned")
    together.feed([2, 3])                           # makes the key's inputs
    key = runner.key([a.image, b.image], 1, False)
    inputs = runner.inputs[key]
    with torch.inference_mode():
        txn = runner._transaction([a.image, b.image], [a.budget, b.budget], 1, False, inputs)
        runner._stage(inputs, txn, [3, 4])
        runner._plan(txn, inputs)
        captured = txn.captured()
        txn.abort()
        (needed, _), _ = captured.peak
        before = a.digest()
        a.budget.limit = a.budget.held + needed - 1
        txn = runner._transaction([a.image, b.image], [a.budget, b.budget], 1, False, inputs, captured)
        try:
            txn.admit_peaks()
            assert isinstance(txn.parts[0].failure, AllocationError) and txn.parts[1].failure is None
            assert b.budget.working > 0 and a.budget.working == 0
        finally:
            txn.abort()
    a.budget.limit = None
    assert a.digest() == before and b.budget.working == 0


def test_a_replay_asks_the_budget_what_the_stages_asked(models):
    """A replay's transaction (borrowing the captured step's work) hears the stages' requests
    as one: it refuses its session under exactly the budgets under which running the stages
    refuses."""
    from hebrus.errors import AllocationError
    model = models["tiny"]
    runner = model.steps(capture=False)
    s = model.session(decode="planned")
    s.feed(tokens(5))
    key = runner.key([s.image], 1, False)
    s.feed([2])                                     # makes the key's inputs
    inputs = runner.inputs[key]

    def run_stages_refused() -> bool:
        txn = runner._transaction([s.image], [s.budget], 1, False, inputs)
        try:
            runner._stage(inputs, txn, [3])
            runner._plan(txn, inputs)
            return False
        except AllocationError:
            return True
        finally:
            txn.abort()

    def replay_refused(captured) -> bool:
        txn = runner._transaction([s.image], [s.budget], 1, False, inputs, captured)
        try:
            assert txn.parts[0].failure is None             # asked once the replay is launched
            txn.admit_peaks()
            return txn.parts[0].failure is not None
        finally:
            txn.abort()

    with torch.inference_mode():
        txn = runner._transaction([s.image], [s.budget], 1, False, inputs)
        runner._stage(inputs, txn, [3])
        runner._plan(txn, inputs)
        captured = txn.captured()
        txn.abort()
        (needed, _), _ = captured.peak
        assert needed > 0
        for limit, refused in ((s.budget.held + needed - 1, True), (s.budget.held + needed, False)):
            s.budget.limit = limit
            assert [replay_refused(captured), run_stages_refused()] == [refused, refused], limit
    s.budget.limit = None
    s.feed([4])


def test_one_plan_serves_any_sessions(models):
    """Sessions joining, leaving, flipping banks and growing their storage step from the same
    plan (the same key: lanes, tokens, table width), and step as the eager runner does."""
    import hebrus
    model = models["qwen3_5"]
    vocab = model.spec.vocab_size
    runner = model.steps(capture=False)
    planned, eager = _pairs(model, [3 + 5 * i for i in range(4)])
    keys = set()
    for step, members in enumerate([(0, 1, 2), (0, 1, 2), (0, 1, 2, 3), (1, 2, 3), (1, 3)] * 4):
        ids = tokens(len(members), seed=50 + step, vocab=vocab)
        got = hebrus.Batch([planned[m] for m in members], decode="planned").feed(ids)
        keys.add(runner.key([planned[m].image for m in members], 1, False))
        for m, g, t in zip(members, got, ids):
            _close(g, eager[m].feed([t]), f"session {m}, step {step}")
    assert keys == {(4, 1, 8, False), (2, 1, 8, False)}     # 3 and 4 sessions share their lanes
    for p, e in zip(planned, eager):
        assert p.image.public.table != () and p.frontier == e.frontier
        a, b = _state(p), _state(e)
        for owner in b:
            _close(a[owner], b[owner], owner)


@pytest.mark.parametrize("kv_cache", ["int8", "fp8"])
def test_lanes_over_a_quantized_cache_match_eager(models, kv_cache):
    """A quantized cache's rows reach the lanes' attention gathered and made dense (their copy's
    blocks named by tables of its own): several sessions of different lengths step as each does
    eagerly. (A K or V value a rounding apart in the two routes may take the next code, which
    moves a logit by a fraction of one code's step: the bound allows for that, and no more.)"""
    import hebrus
    model = models["qwen3_5"].with_kv_cache(kv_cache)
    vocab = model.spec.vocab_size
    planned, eager = _pairs(model, [4 + 9 * i for i in range(3)])
    together = hebrus.Batch(planned, decode="planned")
    for step in range(12):
        ids = tokens(3, seed=70 + step, vocab=vocab)
        for i, (g, t) in enumerate(zip(together.feed(ids), ids)):
            _close(g, eager[i].feed([t]), f"session {i}, step {step}", tolerance=1e-2)


def test_widths_grow_in_powers_of_two_where_no_stage_reads_to_the_width(models):
    """Sparse attention gathers its lanes' rows up to the tables' width: its widths come in
    quarter steps. A model whose stages work to each lane's position (the lanes' attention
    kernel) takes powers of two: a session growing to 4,000 rows (250 blocks) runs in 6 widths
    instead of 21."""
    from hebrus.engine import graphs
    assert graphs.fine_widths(models["tiny"])                             # QSA
    assert [graphs.width_for(b, fine=False) for b in (1, 8, 9, 16, 17, 100, 129)] == [8, 8, 16, 16, 32, 128, 256]
    assert [graphs.width_for(b) for b in (1, 8, 9, 11, 16, 17, 100, 129)] == [8, 8, 10, 12, 16, 20, 112, 160]
    coarse = {graphs.width_for(b, fine=False) for b in range(1, 251)}
    fine = {graphs.width_for(b) for b in range(1, 251)}
    assert len(coarse) == 6 and len(fine) == 21
    model = models["qwen3_5"]
    stage = next(s for s in model.stages if getattr(s, "attn", None) is not None)
    assert stage.reads_to_width == (not getattr(stage.attn.attend_lanes, "reads_to_position", False))
    assert graphs.fine_widths(model) == stage.reads_to_width           # on the CPU: the gathering twin


def test_a_steps_inputs_equal_a_fresh_fill_whatever_came_before(tiny_fast):
    """The host buffer of a key's inputs rewrites a lane's table row only when its table is
    another object; after any sequence of fills (tables growing, lanes swapped, padding lanes,
    a lane failed) it holds exactly what a fresh buffer filled once holds, and each token's
    block and row are its lane's table's at its position."""
    import random
    from hebrus.engine.graphs import Inputs
    pool, width, lanes = tiny_fast.pool, 6, 4
    rng = random.Random(5)
    tables = [tuple(rng.sample(range(pool.blocks), rng.randint(1, width))) for _ in range(6)]
    for length in (1, 3):
        kept = Inputs(pool, lanes, length, width, length > 1)
        last = width * pool.block_rows - length             # a lane's last token still inside the width
        for _ in range(40):
            n = rng.randint(0, lanes)
            choices = tables + [tables[0] + (1,)]                   # a new tuple each time
            live = [None if rng.random() < 0.2 else
                    (rng.randint(0, last), rng.randint(0, 1), rng.randint(0, 3), rng.choice(choices))
                    for _ in range(n)]
            ids = [rng.randint(0, 50) for _ in range(n * length)]
            fresh = Inputs(pool, lanes, length, width, length > 1)
            kept.fill(live, ids)
            fresh.fill(live, ids)
            assert torch.equal(kept.host, fresh.host)
            step = kept.step
            lane = torch.arange(lanes).repeat_interleave(length)
            assert torch.equal(step.blocks, step.tables[lane, step.positions // pool.block_rows])
            assert torch.equal(step.offsets, step.positions % pool.block_rows)
            one = step.session(lanes - 1)                    # a lane's own tokens, as a stage slices them
            assert torch.equal(one.blocks, step.blocks[-length:])
            assert torch.equal(one.offsets, step.offsets[-length:])


def test_blocks_that_cannot_be_zeroed_fail_the_step_and_leak_nothing(models, monkeypatch):
    """When the blocks a planned step's sessions take cannot be zeroed (zeroed together once
    every session has begun), no session publishes and every block goes back to the pool."""
    import hebrus
    from hebrus.errors import ChunkAborted
    model = models["qwen3_5"]
    vocab, pool = model.spec.vocab_size, model.pool
    sessions = [model.session(decode="planned") for _ in range(3)]
    for s in sessions:
        s.feed(tokens(pool.block_rows, seed=7, vocab=vocab))      # a full block: the next token takes one
    before, free = [s.digest() for s in sessions], pool.free_blocks
    real = type(pool)._zero

    def refuse(self, blocks):
        if blocks and getattr(self._zeroing, "blocks", None) is None:
            raise RuntimeError("zeroing refused")
        return real(self, blocks)

    monkeypatch.setattr(type(pool), "_zero", refuse)
    got = hebrus.Batch(sessions, decode="planned").feed(tokens(3, seed=8, vocab=vocab))
    assert all(isinstance(g, ChunkAborted) for g in got)
    assert [s.digest() for s in sessions] == before and pool.free_blocks == free
    monkeypatch.undo()
    assert all(isinstance(g, torch.Tensor) for g in hebrus.Batch(sessions, decode="planned").feed([1, 2, 3]))
