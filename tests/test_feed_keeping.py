"""`Session.feed_keeping`: one chunk published as `feed` publishes it, and for each mark a new
session holding exactly what feeding the chunk up to that mark gives (what the server's prefix
cache keeps as prompts pass)."""
from __future__ import annotations

import pytest
import torch

import hebrus
from hebrus.errors import InvalidInput

TEXT = list(b"When shall we three meet again, in thunder, lightning, or in rain?")
MARKS = [1, 6, 13, 20]


def _warm(model, vocab: int):
    s = model.session()
    s.feed([t % vocab for t in TEXT[:5]])
    return s


def _owners_close(a, b, tolerance: float) -> None:
    for spec in a.image.specs:
        x, y = a.image.value(spec.name), b.image.value(spec.name)
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=tolerance, atol=tolerance, msg=spec.name)
        else:
            assert torch.equal(x, y), spec.name


def test_each_kept_session_is_the_chunk_fed_up_to_its_mark_bit_for_bit(tiny):
    chunk = TEXT[5:25]
    s = _warm(tiny, 256)
    logits, kept = s.feed_keeping(chunk, MARKS)
    whole = _warm(tiny, 256)
    assert torch.equal(logits, whole.feed(chunk)) and s.digest() == whole.digest()
    for mark, k in zip(MARKS, kept):
        alone = _warm(tiny, 256)
        alone.feed(chunk[:mark])
        assert k.frontier == 5 + mark and k.digest() == alone.digest() and torch.equal(k.logits, alone.logits)
        assert torch.equal(k.feed(TEXT[30:34]), alone.feed(TEXT[30:34])) and k.digest() == alone.digest()
    assert s.digest() == whole.digest()         # the kept ones' writes never reach the shared rows


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe", "kimi_linear"])
def test_in_fast_mode_each_kept_session_is_within_the_bound_of_feeding_alone(fast_models, name):
    """Float32 rounding apart: the pieces between marks run the products over fewer rows."""
    model = fast_models[name]
    vocab = model.spec.vocab_size
    chunk = [t % vocab for t in TEXT[5:25]]
    s = _warm(model, vocab)
    _, kept = s.feed_keeping(chunk, MARKS)
    whole = _warm(model, vocab)
    whole.feed(chunk)
    _owners_close(s, whole, 1e-3)
    for mark, k in zip(MARKS, kept):
        alone = _warm(model, vocab)
        alone.feed(chunk[:mark])
        assert k.frontier == alone.frontier
        _owners_close(k, alone, 1e-3)
        torch.testing.assert_close(k.feed([3, 4]), alone.feed([3, 4]), rtol=1e-3, atol=1e-3)


def test_a_kept_session_holds_the_rows_it_shares_and_writes_its_own(tiny):
    """The kept sessions share the chunk's row blocks; writing past a mark copies a block, so
    neither the fed session nor another kept one sees it."""
    s = _warm(tiny, 256)
    _, (early, late) = s.feed_keeping(TEXT[5:40], [3, 30])
    digests = s.digest(), late.digest()
    early.feed(TEXT[50:60])
    assert (s.digest(), late.digest()) == digests
    free = tiny.pool.free_blocks
    del early, late
    import gc
    gc.collect()
    assert tiny.pool.free_blocks >= free


@pytest.mark.parametrize("marks", [[], [0], [3, 3], [5, 2], [21], "abc", 4, [1.5], [True]])
def test_bad_marks_are_refused_and_change_nothing(tiny, marks):
    s = _warm(tiny, 256)
    before = s.digest()
    with pytest.raises(InvalidInput, match="marks|mark"):
        s.feed_keeping(TEXT[5:25], marks)
    assert s.digest() == before and s.frontier == 5


def test_a_failing_chunk_publishes_nothing_and_keeps_nothing(tiny):
    s = _warm(tiny, 256)
    before, slots = s.digest(), tiny.pool.free_slots
    with hebrus.inject(stage=tiny.stage_names[2], kind="nonfinite"):
        with pytest.raises(hebrus.ChunkAborted):
            s.feed_keeping(TEXT[5:25], MARKS)
    assert s.digest() == before and tiny.pool.free_slots == slots


def test_a_full_pool_publishes_the_chunk_and_keeps_none(tmp_path):
    one = hebrus.load("tiny").pool
    model = hebrus.load("tiny", pool_bytes=8 * one.slot_nbytes + 64 * one.block_nbytes)
    s, held = _warm(model, 256), []
    while True:                                 # every slot held but one
        try:
            held.append(model.session())
        except hebrus.AllocationError:
            break
    held.pop()
    _, kept = s.feed_keeping(TEXT[5:25], MARKS)
    assert kept[0] is not None and kept[1:] == [None] * 3 and s.frontier == 25
    assert s.digest() == _published(TEXT[5:25])


def _published(chunk) -> str:
    s = _warm(hebrus.load("tiny"), 256)
    s.feed(chunk)
    return s.digest()


def test_a_stage_that_keeps_no_value_after_the_marks_aborts_the_chunk(tiny, monkeypatch):
    """A stage writing only the last value where marks ask for every one: the chunk is refused
    (a structural abort), not published with kept sessions missing that owner's values."""
    from hebrus.state.txn import Transaction
    s = _warm(tiny, 256)
    before = s.digest()
    monkeypatch.setattr(Transaction, "write_each", lambda txn, name, values: txn.write(name, values[-1]))
    with pytest.raises(hebrus.ChunkAborted, match="no value after every token or mark"):
        s.feed_keeping(TEXT[5:25], MARKS)
    assert s.digest() == before and s.frontier == 5


# ---- several sessions in one pass: feed_keeping_many ---------------------------------------------
CHUNKS = [TEXT[5:25], TEXT[30:33], TEXT[40:57]]
MANY = [[1, 6, 13, 20], [], [4, 8, 9, 16]]      # the second keeps nothing


def _warm_many(model, vocab: int) -> list:
    out = []
    for i in range(len(CHUNKS)):
        s = model.session()
        s.feed([t % vocab for t in TEXT[i:i + 3 + 2 * i]])     # frontiers 3, 5, 7
        out.append(s)
    return out


def _fed_alone(model, vocab: int, i: int, chunk: list[int], marks: list[int]):
    s = _warm_many(model, vocab)[i]
    return (s, *(s.feed_keeping(chunk, marks) if marks else (s.feed(chunk), [])))


def test_several_sessions_keep_in_one_pass_exactly_what_each_keeps_alone(tiny):
    from hebrus.batching import feed_keeping_many
    sessions = _warm_many(tiny, 256)
    got = feed_keeping_many(sessions, CHUNKS, MANY)
    for i, (session, (logits, kept)) in enumerate(zip(sessions, got)):
        alone, want, want_kept = _fed_alone(tiny, 256, i, CHUNKS[i], MANY[i])
        assert torch.equal(logits, want) and session.digest() == alone.digest(), i
        assert len(kept) == len(want_kept) == len(MANY[i])
        for k, w in zip(kept, want_kept):
            assert k.frontier == w.frontier and k.digest() == w.digest() and torch.equal(k.logits, w.logits)


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe", "kimi_linear"])
def test_in_fast_mode_several_sessions_keep_within_the_bound_of_each_alone(fast_models, name):
    """Fast mode runs the three chunks in one pass, the delta rule's pieces between marks in
    rounds (a round: every session's next piece, one call); each kept session and each fed one
    is within fast mode's bound of its chunk fed alone up to that point."""
    from hebrus.batching import feed_keeping_many
    model = fast_models[name]
    vocab = model.spec.vocab_size
    chunks = [[t % vocab for t in c] for c in CHUNKS]
    sessions = _warm_many(model, vocab)
    got = feed_keeping_many(sessions, chunks, MANY)
    for i, (session, (logits, kept)) in enumerate(zip(sessions, got)):
        alone = _warm_many(model, vocab)[i]
        torch.testing.assert_close(logits, alone.feed(chunks[i]), rtol=1e-3, atol=1e-3)
        _owners_close(session, alone, 1e-3)
        for mark, k in zip(MANY[i], kept):
            up_to = _warm_many(model, vocab)[i]
            up_to.feed(chunks[i][:mark])
            assert k.frontier == up_to.frontier
            _owners_close(k, up_to, 1e-3)
            torch.testing.assert_close(k.feed([3, 4]), up_to.feed([3, 4]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_one_sessions_failure_keeps_nothing_for_it_and_leaves_the_others_kept(mode):
    from hebrus.batching import feed_keeping_many
    model = hebrus.load("tiny", mode=mode)
    sessions = _warm_many(model, 256)
    before = sessions[2].digest()
    with hebrus.inject(stage=model.stage_names[3], kind="nonfinite", session=sessions[2]):
        got = feed_keeping_many(sessions, CHUNKS, MANY)
    assert isinstance(got[2], hebrus.ChunkAborted) and sessions[2].digest() == before and sessions[2].frontier == 7
    for i in (0, 1):
        alone, want, want_kept = _fed_alone(model, 256, i, CHUNKS[i], MANY[i])
        logits, kept = got[i]
        assert sessions[i].frontier == alone.frontier and len(kept) == len(MANY[i])
        if mode == "exact":
            assert sessions[i].digest() == alone.digest()
            assert [k.digest() for k in kept] == [w.digest() for w in want_kept]


@pytest.mark.parametrize("marks", [[[1], []], [[1], [], [], []], [[0], [], []], [[], [4], []], "x", [[2, 1], [], []]])
def test_bad_marks_for_several_sessions_are_refused_and_change_nothing(tiny, marks):
    from hebrus.batching import feed_keeping_many
    sessions = _warm_many(tiny, 256)
    before = [s.digest() for s in sessions]
    with pytest.raises(InvalidInput, match="marks|mark"):
        feed_keeping_many(sessions, CHUNKS, marks)
    assert [s.digest() for s in sessions] == before


def test_a_sessions_budget_counts_only_its_own_kept_values():
    """Beside a session keeping forty states, one with a memory budget that its chunk and one
    mark fit alone is not refused: each session's budget is asked for its own kept values."""
    from hebrus.batching import feed_keeping_many
    model = hebrus.load("tiny", mode="fast")
    mine, theirs = list(range(13, 33)), list(range(53, 93))

    def warm(limit=None):
        s = hebrus.Session(model, memory_budget=limit)
        s.feed([3, 4, 5])
        return s
    need = None
    for limit in (1 << 12) * torch.arange(1, 400):      # the least budget (in 4 KiB steps) it takes alone
        try:
            warm(int(limit)).feed_keeping(mine, [5])
        except (hebrus.AllocationError, InvalidInput):  # (too small for a session, or for the chunk)
            continue
        need = int(limit)
        break
    assert need is not None
    budgeted, other = warm(need), warm()
    got = feed_keeping_many([budgeted, other], [mine, theirs], [[5], list(range(1, 41))])
    assert not isinstance(got[0], BaseException) and len(got[1][1]) == 40
