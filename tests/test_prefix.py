"""`Session.feed_prefix`: a chunk's own logits decide how many of its tokens to keep, and only
those are published: the same state, bit for bit, as feeding that prefix alone."""
from __future__ import annotations

import pytest
import torch

import hebrus
from hebrus.errors import InvalidInput

TEXT = list(b"When shall we three meet again")


def _warm(model):
    s = model.session()
    s.feed(TEXT[:5])
    return s


def test_every_prefix_equals_feeding_it_alone(tiny):
    chunk = TEXT[5:12]
    for k in range(len(chunk) + 1):
        s = _warm(tiny)
        kept, logits = s.feed_prefix(chunk, lambda logits, k=k: k)
        alone = _warm(tiny)
        if k:
            alone.feed(chunk[:k])
            assert torch.equal(logits[k - 1], alone.logits)
        assert kept == k and s.digest() == alone.digest() and s.frontier == 5 + k
        assert logits.shape == (len(chunk), tiny.spec.vocab_size)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_one_pass_equals_its_readable_twin(tiny, tiny_fast, mode):
    """The prefix transaction (one pass) against the two-pass form: the same logits and state,
    bit for bit in exact mode, within fast mode's bound in fast mode (its per-token states come
    from one block of the chunked delta rule)."""
    model = tiny if mode == "exact" else tiny_fast
    chunk = TEXT[5:14]
    for k in range(len(chunk) + 1):
        one, two = _warm(model), _warm(model)
        k1, logits1 = one.feed_prefix(chunk, lambda logits, k=k: k)
        k2, logits2 = two.feed_prefix_twice(chunk, lambda logits, k=k: k)
        assert k1 == k2 == k and one.frontier == two.frontier == 5 + k
        if mode == "exact":
            assert torch.equal(logits1, logits2) and one.digest() == two.digest()
        else:
            torch.testing.assert_close(logits1, logits2, rtol=1e-4, atol=1e-4)
            for name in ("layers.0.gdn.recurrent", "ple.conv", "residual", "logits"):
                torch.testing.assert_close(one.image.read(name), two.image.read(name), rtol=1e-4, atol=1e-4)
            for name in ("frontier", "ple.history"):
                assert torch.equal(one.image.read(name), two.image.read(name))
            for name in one.model.pool.rows:
                torch.testing.assert_close(one.image.rows(name), two.image.rows(name), rtol=1e-4, atol=1e-4)
        one.feed(TEXT[14:17])                     # and they go on alike
        two.feed(TEXT[14:17])
        if mode == "exact":
            assert one.digest() == two.digest()


def test_every_kind_of_failure_at_every_stage_publishes_nothing(tiny):
    s = _warm(tiny)
    digest, calls = s.digest(), []
    for stage in tiny.stage_names:
        for kind in hebrus.FAULT_KINDS:
            with hebrus.inject(stage=stage, kind=kind):
                with pytest.raises(hebrus.ChunkAborted) as caught:
                    s.feed_prefix(TEXT[5:12], lambda logits: calls.append(1) or 3)
            assert caught.value.stage == stage and caught.value.kind == kind
            assert s.digest() == digest and not calls
    assert s.feed_prefix(TEXT[5:12], lambda logits: 3)[0] == 3 and s.frontier == 8


def test_the_rejected_tail_never_reaches_a_planned_step(tiny_fast):
    """Rows of the tokens after k stay past the frontier; a planned step reads every row its
    table holds (masked), so they are zeroed before it runs, as an aborted chunk's are, and its steps then
    match the eager runner's."""
    chunk = TEXT[5:12]
    planned, eager = tiny_fast.session(decode="planned", reserve=64), tiny_fast.session(decode="eager")
    for s in (planned, eager):
        s.feed(TEXT[:5])
        s.feed_prefix(chunk, lambda logits: 3)
    first = planned.image.appended[0].name
    assert planned.image.tail_dirty and planned.image.held_rows(first)[8:].abs().sum() > 0
    for token in TEXT[8:14]:
        torch.testing.assert_close(planned.feed([token]), eager.feed([token]), rtol=2e-5, atol=2e-5)
    assert planned._steps.uncaptured >= 5
    for spec in planned.image.appended:
        assert not planned.image.held_rows(spec.name)[planned.frontier:].any()


def test_the_logits_decide(tiny):
    """Keep tokens while the previous position's greedy choice predicts them (a draft check)."""
    chunk = TEXT[5:12]

    def agreeing(logits):
        k = 1
        while k < len(chunk) and int(logits[k - 1].argmax()) == chunk[k]:
            k += 1
        return k
    s = _warm(tiny)
    kept, logits = s.feed_prefix(chunk, agreeing)
    assert kept == agreeing(logits) and s.frontier == 5 + kept


@pytest.mark.parametrize("stage", ["embed", "ple", "layers.0.gdn", "layers.1.qsa", "layers.3.ffn", "head"])
def test_a_failure_in_either_pass_publishes_nothing(tiny, stage):
    s = _warm(tiny)
    digest = s.digest()
    with hebrus.inject(stage=stage, kind="nonfinite"):
        with pytest.raises(hebrus.NonFiniteError):
            s.feed_prefix(TEXT[5:12], lambda logits: 4)
    assert s.digest() == digest
    calls = []

    def fail_second(logits):
        calls.append(1)
        return 3
    with hebrus.inject(stage=stage, kind="command"):        # armed for the verify pass: it fails there
        with pytest.raises(hebrus.CommandError):
            s.feed_prefix(TEXT[5:12], fail_second)
    assert s.digest() == digest and not calls


@pytest.mark.parametrize("bad", [-1, 8, 2.5, "3", True, None])
def test_a_bad_answer_from_accept_changes_nothing(tiny, bad):
    s = _warm(tiny)
    digest = s.digest()
    with pytest.raises(InvalidInput, match="from 0 to 7"):
        s.feed_prefix(TEXT[5:12], lambda logits: bad)
    assert s.digest() == digest


def test_accept_raising_changes_nothing(tiny):
    s = _warm(tiny)
    digest = s.digest()

    def broken(logits):
        raise ValueError("no")
    with pytest.raises(ValueError):
        s.feed_prefix(TEXT[5:12], broken)
    with pytest.raises(InvalidInput, match="accept must be a function"):
        s.feed_prefix(TEXT[5:12], 3)
    assert s.digest() == digest


def test_a_partly_kept_chunk_is_journaled_and_replayed_as_it_ran(tmp_path, tiny_fast):
    """Fast mode: a prefix transaction's values are not bit for bit a plain chunk's, so the
    journal records the whole chunk, how much of it was kept and that it was a prefix
    transaction, and replays that."""
    s = tiny_fast.session(journal=tmp_path / "j")
    s.feed(TEXT[:5])
    s.feed_prefix(TEXT[5:12], lambda logits: 2)
    s.feed_prefix(TEXT[7:10], lambda logits: 0)               # nothing kept: no record
    s.feed_prefix(TEXT[7:10], lambda logits: 3)
    s.journal.close()
    back = tiny_fast.recover(tmp_path / "j")
    assert back.frontier == 10 and back.digest() == s.digest()
    from hebrus import journal
    records, _, _ = journal.read(tmp_path / "j", tiny_fast.fingerprint, tiny_fast.spec.max_context)
    assert [(start, len(ids), kept, prefix) for start, ids, kept, prefix in records] == \
        [(0, 5, 5, False), (5, 7, 2, True), (7, 3, 3, True)]


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "qwen3_5_moe"])
def test_planned_prefix_transactions_match_eager(fast_models, name):
    """A prefix transaction from the static plan (what a CUDA graph captures; uncaptured here)
    against the eager runner's: the same logits and kept state within fast mode's tolerance, the
    same routes, and the plan reused for every chunk of its length."""
    model = fast_models[name]
    vocab = model.spec.vocab_size
    prompt = [t % vocab for t in TEXT[:9]]
    planned, eager = model.session(decode="planned", reserve=64), model.session(decode="eager")
    for s in (planned, eager):
        s.feed(prompt)
    runner = model.steps(capture=False)
    ran = runner.uncaptured
    for k in (2, 0, 5, 3):
        chunk = [(t * 7 + k) % vocab for t in TEXT[9:14]]
        k1, logits1 = planned.feed_prefix(chunk, lambda logits, k=k: k)
        k2, logits2 = eager.feed_prefix(chunk, lambda logits, k=k: k)
        assert k1 == k2 == k and planned.frontier == eager.frontier
        torch.testing.assert_close(logits1, logits2, rtol=2e-5, atol=2e-5)
        for spec in planned.image.specs:
            a, b = planned.image.value(spec.name), eager.image.value(spec.name)
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
            else:
                assert torch.equal(a, b), spec.name
    assert runner.uncaptured - ran == 4
    torch.testing.assert_close(planned.feed([3]), eager.feed([3]), rtol=2e-5, atol=2e-5)


def test_speculation_on_a_planned_session_pads_its_chunks_to_one_length():
    model = hebrus.load("tiny").with_mode("fast")  # its own runner: no other test's keys
    prompt = list(b"abcabcabcabcabcabc")
    plain = model.session(decode="planned", reserve=128)
    want = list(plain.generate(prompt, max_new_tokens=24))
    spec = model.session(decode="planned", reserve=128)
    runner, ran = spec._steps, spec._steps.uncaptured
    got = list(spec.generate(prompt, max_new_tokens=24, speculate="lookup", draft_tokens=4))
    assert got == want and spec.frontier == plain.frontier
    assert runner.uncaptured > ran
    assert {key[1] for key in runner.warm if key[3]} == {5}


class _Liar(int):
    """An int whose comparisons say whatever lets it through."""
    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True

    def __lt__(self, other):
        return False

    def __gt__(self, other):
        return False


@pytest.mark.parametrize("answer", [torch.tensor(2.7), torch.tensor(True), torch.tensor([2]), _Liar(100),
                                    _Liar(-3), 2.0, True, "2", None, torch.tensor(7), torch.tensor(-1)])
def test_accept_must_answer_a_plain_integer_in_range(tiny, answer):
    s = tiny.session()
    s.feed(TEXT[:4])
    before = s.digest()
    with pytest.raises(hebrus.InvalidInput, match="integer from 0 to 6"):
        s.feed_prefix(TEXT[4:10], lambda logits: answer)
    assert s.digest() == before and s.frontier == 4


@pytest.mark.parametrize("answer", [4, torch.tensor(4), torch.tensor(4, dtype=torch.int32)])
def test_accept_may_answer_an_int_or_an_integer_scalar_tensor(tiny, answer):
    s, plain = tiny.session(), tiny.session()
    s.feed(TEXT[:4])
    plain.feed(TEXT[:4])
    assert s.feed_prefix(TEXT[4:10], lambda logits: answer)[0] == 4
    plain.feed(TEXT[4:8])
    assert s.digest() == plain.digest()
