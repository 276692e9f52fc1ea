"""Speculative decoding (`hebrus.speculate`): greedy output equal to plain greedy decoding, bit
for bit in exact mode, with prompt lookup and with a draft model; sampled output that follows
plain sampling's distribution (a chi-square test, and a broken verifier that fails it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hebrus
from hebrus import speculate
from hebrus.models.hebrus import preset
from hebrus.errors import InvalidInput
from hebrus.runtime import Model
from hebrus.sampling import Sampling, distribution
from hebrus.session import Session

PROMPT = list(b"abcabcabca")


@pytest.fixture(scope="module")
def draft_of_tiny():
    """A fast-mode draft for `tiny`: its weights with 5% noise, so it proposes what tiny would
    often but not always."""
    config = preset("tiny")
    g = torch.Generator().manual_seed(5)
    params = {name: value + 0.05 * value.std() * torch.randn(value.shape, generator=g)
              if value.is_floating_point() and value.numel() > 1 and "A_log" not in name else value
              for name, value in config.init_parameters().items()}
    return Model(config, params, mode="fast")


def test_lookup_drafts_what_followed_the_latest_ngram():
    assert speculate.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 4) == [7, 5, 1, 2]     # the latest 3-gram match
    assert speculate.lookup([4, 8, 4], 3) == [8, 4]                                    # down to one token
    assert speculate.lookup([1, 2, 3], 5) == [] and speculate.lookup([1, 1], 0) == []


def _counting_kept(monkeypatch) -> list[int]:
    kept, real = [], Session.feed_prefix

    def counted(self, ids, accept):
        k, logits = real(self, ids, accept)
        kept.append(k)
        return k, logits
    monkeypatch.setattr(Session, "feed_prefix", counted)
    return kept


@pytest.mark.parametrize("name", ["tiny", "shakespeare"])
def test_greedy_lookup_gives_the_plain_greedy_output(name, monkeypatch):
    """Exact mode: the same tokens and the same final state, bit for bit, with chunks of several
    tokens kept at once where the drafts agree."""
    model = hebrus.load(name)
    prompt = list(b"To be, or not to be, that is the question. To be, or not to be, that is")
    plain = model.session()
    want = list(plain.generate(prompt, max_new_tokens=30))
    kept = _counting_kept(monkeypatch)
    spec = model.session()
    got = list(spec.generate(prompt, max_new_tokens=30, speculate="lookup"))
    assert got == want and spec.digest() == plain.digest()
    assert kept                                       # drafts were tried ...
    if name == "shakespeare":                         # ... and a trained model agrees with some
        assert max(kept) > 1


def test_greedy_with_a_draft_model_gives_the_plain_greedy_output(tiny, draft_of_tiny, monkeypatch):
    plain = tiny.session()
    want = list(plain.generate(PROMPT, max_new_tokens=20))
    kept = _counting_kept(monkeypatch)
    spec = tiny.session()
    got = list(spec.generate(PROMPT, max_new_tokens=20, speculate=draft_of_tiny, draft_tokens=4))
    assert got == want and spec.digest() == plain.digest()
    assert max(kept) > 1 and min(kept) < 5            # drafts kept, and drafts refused


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_speculation_stops_where_plain_decoding_stops(tiny, draft_of_tiny, drafter):
    prompt = list(b"abcabcabcabc")
    how = "lookup" if drafter == "lookup" else draft_of_tiny
    plain = list(tiny.session().generate(prompt, max_new_tokens=12))
    stop = plain[4]
    want = plain[:plain.index(stop) + 1]
    s = tiny.session()
    assert list(s.generate(prompt, max_new_tokens=12, speculate=how, stop_ids=[stop])) == want
    assert s.frontier == len(prompt) + len(want)      # nothing after the stop was published
    assert len(list(tiny.session().generate(prompt, max_new_tokens=5, speculate=how))) == 5


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's upper 0.001 point (z = 3.09), by Wilson and Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _pairs_test(model, how, runs: int, seen: list[int]) -> tuple[float, float, list[int]]:
    """Sample two tokens after PROMPT `runs` times (seeds 0..runs-1, one draft token) and
    compare the pairs with their exact probabilities under plain sampling (temperature 1, top 3).
    Returns (chi-square, infinite if a pair plain sampling cannot give came out; its 0.001
    critical value; the kept counts of the verifying chunks)."""
    sampling = Sampling(temperature=1.0, top_k=3)
    base = model.session()
    base.feed(PROMPT)

    def probabilities(logits):
        weights = distribution(logits, sampling)
        return weights / weights.sum()
    first, pairs = probabilities(base.logits), {}
    for a in torch.nonzero(first).flatten().tolist():
        second = probabilities(base.fork().feed([a]))
        for b in torch.nonzero(second).flatten().tolist():
            pairs[(a, b)] = float(first[a] * second[b])
    kept, real = [], speculate._verify

    def counted(*args):
        k, following = real(*args)
        kept.append(k)
        return k, following
    counts, impossible = dict.fromkeys(pairs, 0), 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculate, "_verify", counted)
        for seed in range(runs):
            out = tuple(base.fork().generate([], max_new_tokens=2, temperature=1.0, top_k=3, seed=seed,
                                             speculate=how, seen=seen, draft_tokens=1))
            if out in counts:
                counts[out] += 1
            else:
                impossible += 1
    chi = sum((counts[c] - runs * p) ** 2 / (runs * p) for c, p in pairs.items()) if not impossible else float("inf")
    return chi, _chi_square_critical(len(pairs) - 1), kept


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_sampled_speculation_follows_the_sampling_distribution(tiny_fast, draft_of_tiny, drafter):
    """Speculative rejection sampling: the pairs of tokens it emits are distributed as plain
    sampling's, while some drafts are kept and some refused. The lookup drafts come from `seen`,
    which holds a likely and an unlikely continuation of each of the three likely first tokens."""
    if drafter == "lookup":
        base = tiny_fast.session()
        base.feed(PROMPT)
        first = torch.topk(base.logits, 3).indices.tolist()
        seen = PROMPT[:]
        for a in first:
            ranked = torch.topk(base.fork().feed([a]), 3).indices.tolist()
            seen += [a, ranked[0 if a == first[0] else 2]]
        chi, critical, kept = _pairs_test(tiny_fast, "lookup", 600, seen)
    else:
        chi, critical, kept = _pairs_test(tiny_fast, draft_of_tiny, 300, PROMPT)
    assert len(kept) > 100 and 0.2 < sum(k == 2 for k in kept) / len(kept) < 0.9
    assert chi < critical, (chi, critical)


def test_the_distribution_test_fails_a_verifier_that_keeps_every_draft(tiny_fast, draft_of_tiny, monkeypatch):
    """The test above can fail: keeping every draft gives the draft model's distribution."""
    def keep_all(chunk, logits, proposals, sampling, generator, stops, ended=None):
        return len(chunk), speculate.sample(logits[-1], sampling, generator)
    monkeypatch.setattr(speculate, "_verify", keep_all)
    chi, critical, _ = _pairs_test(tiny_fast, draft_of_tiny, 150, PROMPT)
    assert chi > critical, (chi, critical)


def test_speculation_arguments_are_checked(tiny):
    s = tiny.session()
    with pytest.raises(InvalidInput, match="repetition, presence or frequency penalty"):
        s.generate([1, 2], temperature=0.7, repetition_penalty=1.2, speculate="lookup")
    with pytest.raises(InvalidInput, match="repetition, presence or frequency penalty"):
        s.generate([1, 2], temperature=0.7, presence_penalty=0.5, speculate="lookup")
    with pytest.raises(InvalidInput, match="'lookup' or a hebrus model"):
        s.generate([1, 2], speculate="draft")
    other = dataclasses.replace(preset("tiny"), vocab_size=128)
    with pytest.raises(InvalidInput, match="vocabulary has 128 ids"):
        s.generate([1, 2], speculate=Model(other, other.init_parameters()))
    short = dataclasses.replace(preset("tiny"), max_context=16)
    with pytest.raises(InvalidInput, match="context limit of 16"):
        s.generate(list(range(10)), max_new_tokens=8, speculate=Model(short, short.init_parameters()))
    with pytest.raises(InvalidInput, match="draft_tokens"):
        s.generate([1, 2], speculate="lookup", draft_tokens=-1)
    assert s.frontier == 0
