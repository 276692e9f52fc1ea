"""Chunk size is a scheduling choice: exact mode is bit-identical under any chunking or
interleaving (float32 and float64); fast mode, with exact's discrete choices replayed, is within
tolerance of exact, flips a choice only at a near-tie, and decodes the same greedy tokens except
at near-ties (see tests/test_fast_bound.py)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hebrus.bound import BOUNDS, compare_replayed
from hebrus.verify import fast_greedy_like_exact

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

ids_and_cuts = st.lists(st.integers(0, 255), min_size=1, max_size=36).flatmap(
    lambda ids: st.tuples(st.just(ids), st.lists(st.integers(1, len(ids)), max_size=8)))


def _chunks(ids, cuts):
    edges = sorted({0, len(ids), *cuts})
    return [ids[a:b] for a, b in zip(edges, edges[1:])]


def _feed(model, chunks):
    s = model.session()
    logits = None
    for chunk in chunks:
        logits = s.feed(chunk)
    return s, logits


@pytest.mark.parametrize("fixture", ["tiny", "tiny64"])
def test_exact_any_chunking_is_bit_identical(fixture, request):
    model = request.getfixturevalue(fixture)

    @SETTINGS
    @given(ids_and_cuts)
    def check(case):
        ids, cuts = case
        whole, logits = _feed(model, [ids])
        split, split_logits = _feed(model, _chunks(ids, cuts))
        assert split.digest() == whole.digest()
        assert torch.equal(split_logits, logits)

    check()


def test_exact_single_tokens_equal_one_chunk(tiny64):
    ids = list(range(30, 70))
    whole, logits = _feed(tiny64, [ids])
    single, single_logits = _feed(tiny64, [[t] for t in ids])
    assert single.digest() == whole.digest() and torch.equal(single_logits, logits)


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=20), min_size=2, max_size=3),
       st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), min_size=1, max_size=40))
def test_exact_interleaved_sessions_match_solo_runs(tiny, conversations, schedule):
    sessions = [tiny.session() for _ in conversations]
    at = [0] * len(conversations)
    for who, size in schedule:
        who %= len(conversations)
        if at[who] < len(conversations[who]):
            sessions[who].feed(conversations[who][at[who]:at[who] + size])
            at[who] = min(at[who] + size, len(conversations[who]))
    for who, ids in enumerate(conversations):
        if at[who] < len(ids):
            sessions[who].feed(ids[at[who]:])
        solo, _ = _feed(tiny, [ids])
        assert sessions[who].digest() == solo.digest()


@SETTINGS
@given(ids_and_cuts)
def test_fast_with_exacts_choices_is_within_tolerance_of_exact(tiny_fast, case):
    ids, cuts = case
    result = compare_replayed(tiny_fast, ids, [[len(c) for c in _chunks(ids, cuts)]])
    assert result.problems(BOUNDS[torch.float32]) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_greedy_tokens_equal_exact_except_at_near_ties(tiny_fast, seed):
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
    verdict = fast_greedy_like_exact(tiny_fast, prompt, 32)
    assert verdict.passed, verdict.detail


def test_fast_long_prefill_crosses_gdn_chunk_boundaries(tiny_fast):
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    result = compare_replayed(tiny_fast, ids, [[130, 20], [64, 1, 85]])
    assert result.problems(BOUNDS[torch.float32]) == []


def test_exact_long_context_chunks_equal_single_tokens():
    """A few thousand tokens, far past the indexer's top-k: prefill in large chunks and token
    by token give bit-identical state (a two-layer Hebrus model keeps this quick)."""
    import hebrus
    from hebrus.models.hebrus import preset
    c = preset("tiny").replace(max_context=4096, num_layers=2, layer_types=("gdn", "qsa"), hc_streams=2,
                               hc_sinkhorn_iters=2, qsa_top_k=16)
    model = hebrus.Model(c, c.init_parameters(), mode="exact")
    ids = torch.randint(0, 256, (2200,), generator=torch.Generator().manual_seed(0)).tolist()
    chunked, single = model.session(reserve=2200), model.session()
    chunked.prefill(ids, chunk_size=733)
    single.prefill(ids, chunk_size=1)
    assert chunked.digest() == single.digest()


def test_a_long_fast_chunk_is_scored_a_block_of_queries_at_a_time(monkeypatch):
    """Fast mode scores a long chunk's queries in blocks (memory O(block × context)): the same
    state and logits as scoring the chunk at once, within float rounding."""
    import hebrus
    from hebrus.models.hebrus import preset
    from hebrus.layers import attention as qsa
    c = preset("tiny").replace(max_context=2048, qsa_top_k=16)
    model = hebrus.Model(c, c.init_parameters(), mode="fast", dtype=torch.float64)
    ids = torch.randint(0, 256, (900,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = model.session()
    whole.feed(ids[:100])
    whole_logits = whole.feed(ids[100:])
    seen = []
    real = qsa.index_scores
    monkeypatch.setattr(qsa, "QUERY_BLOCK", 128)
    monkeypatch.setattr(qsa, "index_scores", lambda qi, iw, ki: seen.append(qi.shape[0]) or real(qi, iw, ki))
    blocked = model.session()
    blocked.feed(ids[:100])
    seen.clear()
    blocked_logits = blocked.feed(ids[100:])
    assert max(seen) == 128 and len(seen) == 2 * 7          # two QSA layers, 800 queries in 7 blocks
    torch.testing.assert_close(blocked_logits, whole_logits, rtol=1e-10, atol=1e-10)
    for spec in whole.image.specs:
        a, b = whole.image.value(spec.name), blocked.image.value(spec.name)
        assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_residual_add_left_to_the_next_norm_changes_no_bit(tmp_path, family):
    """Fast mode with one plain stream adds a sublayer's output in the next norm's op
    (`StepBatch.pending`, `ops.norm.add_rms_norm`); made where each sublayer ends, its readable
    twin, the add gives the same logits and state bit for bit on the CPU: a chunk, single
    tokens, sessions' single tokens together, a ragged step and a prefix transaction."""
    import hebrus
    from foreign import build
    folder, _ = build(family, tmp_path)
    deferred, twin = (hebrus.load(folder, mode="fast") for _ in range(2))
    for stage in twin.stages:
        if getattr(stage, "defer", False):
            stage.defer = False
    assert sum(getattr(stage, "defer", False) for stage in deferred.stages) >= 2

    def run(model):
        a, b = model.session(), model.session()
        out = [a.feed(list(range(1, 12))), b.feed([3, 4]), a.feed([5]), b.feed([6])]
        out += hebrus.feed_many([a, b], [[7], [8]])
        out += hebrus.feed_many([a, b], [[9, 10, 11], [12]])
        k, logits = a.feed_prefix([13, 14, 15], lambda logits: 2)
        return out + [logits], [s.digest() for s in (a, b)]

    (got, got_digests), (want, want_digests) = run(deferred), run(twin)
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and len(got) == len(want) == 9
    assert got_digests == want_digests
