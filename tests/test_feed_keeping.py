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


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe"])
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
