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


def test_only_the_kept_prefix_is_journaled(tmp_path, tiny_fast):
    s = tiny_fast.session(journal=tmp_path / "j")
    s.feed(TEXT[:5])
    s.feed_prefix(TEXT[5:12], lambda logits: 2)
    s.journal.close()
    back = tiny_fast.recover(tmp_path / "j")
    assert back.frontier == 7 and back.digest() == s.digest()


def test_lookup_drafts_what_followed_the_latest_ngram():
    from hebrus.speculate import lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 4) == [7, 5, 1, 2]      # the latest 3-gram match
    assert lookup([4, 8, 4], 3) == [8, 4]                                     # down to one token
    assert lookup([1, 2, 3], 5) == [] and lookup([1, 1], 0) == []


@pytest.mark.parametrize("name", ["tiny", "shakespeare"])
def test_speculative_greedy_decoding_gives_the_plain_greedy_output(name, monkeypatch):
    """Exact mode: the same tokens and the same final state, bit for bit, with chunks of several
    tokens kept at once where the drafts agree."""
    from hebrus.session import Session
    model = hebrus.load(name)
    prompt = list(b"To be, or not to be, that is the question. To be, or not to be, that is")
    plain = model.session()
    want = list(plain.generate(prompt, max_new_tokens=30))
    kept = []
    real = Session.feed_prefix

    def counted(self, ids, accept):
        k, logits = real(self, ids, accept)
        kept.append(k)
        return k, logits
    monkeypatch.setattr(Session, "feed_prefix", counted)
    spec = model.session()
    got = list(spec.generate(prompt, max_new_tokens=30, speculate="lookup"))
    assert got == want and spec.digest() == plain.digest()
    assert kept                                       # drafts were tried ...
    if name == "shakespeare":                         # ... and a trained model agrees with some
        assert max(kept) > 1


def test_speculation_stops_where_plain_decoding_stops(tiny):
    prompt = list(b"abcabcabcabc")
    plain = list(tiny.session().generate(prompt, max_new_tokens=12))
    stop = plain[4]
    want = plain[:plain.index(stop) + 1]
    got = list(tiny.session().generate(prompt, max_new_tokens=12, speculate="lookup", stop_ids=[stop]))
    assert got == want
    assert len(list(tiny.session().generate(prompt, max_new_tokens=5, speculate="lookup"))) == 5


def test_speculation_is_greedy_only(tiny):
    s = tiny.session()
    with pytest.raises(InvalidInput, match="greedily"):
        s.generate([1, 2], temperature=0.7, speculate="lookup")
    with pytest.raises(InvalidInput, match="'lookup'"):
        s.generate([1, 2], speculate="draft")
