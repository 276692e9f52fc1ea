"""Every fast op against its slow twin (outputs and final state), and ops against their definitions."""
import contextlib
import itertools

import pytest
import torch

from hebrus.ops.choose import PACK_FROM, gaps, top_k, top_k_packed, top_k_sorted
from hebrus.ops.conv import causal_conv
from hebrus.ops.gdn import gdn_chunked, gdn_recurrent, gdn_recurrent_states, gdn_states
from hebrus.ops.hyper import hc_post, hc_pre, sinkhorn
from hebrus.ops.moe import experts_grouped, experts_grouped_mm, experts_per_token, route
from hebrus.ops.norm import l2_norm
from hebrus.ops.ple import ngram_buckets
from hebrus.ops.qsa import index_scores, select, sparse_attention
from hebrus.ops.rope import apply_rope, rope_tables


def _gdn_inputs(T, H=3, dk=16, dv=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(T, H, dk, generator=g, dtype=dtype)) * dk ** -0.5
    k = l2_norm(torch.randn(T, H, dk, generator=g, dtype=dtype))
    v = torch.randn(T, H, dv, generator=g, dtype=dtype)
    gate = -torch.rand(T, H, generator=g, dtype=dtype) * 0.5
    beta = torch.rand(T, H, generator=g, dtype=dtype)
    state = torch.randn(H, dk, dv, generator=g, dtype=dtype)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 4), (63, 64), (64, 64), (65, 64), (130, 16), (200, 64)])
def test_gdn_chunked_equals_recurrence_output_and_state(T, chunk):
    q, k, v, g, b, s = _gdn_inputs(T)
    before = s.clone()
    o1, s1 = gdn_recurrent(q, k, v, g, b, s)
    o2, s2 = gdn_chunked(q, k, v, g, b, s, chunk=chunk)
    assert torch.equal(s, before), "the initial state must not be written"
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)


def test_gdn_chunked_float32_within_tolerance():
    q, k, v, g, b, s = (t.float() for t in _gdn_inputs(300, seed=1))
    o1, s1 = gdn_recurrent(q, k, v, g, b, s)
    o2, s2 = gdn_chunked(q, k, v, g, b, s)
    assert (o1 - o2).abs().max() / o1.abs().max() < 1e-5
    assert (s1 - s2).abs().max() / s1.abs().max() < 1e-5


def test_gdn_state_carries_across_calls():
    q, k, v, g, b, s = _gdn_inputs(90, seed=2)
    o, s_all = gdn_chunked(q, k, v, g, b, s)
    o_a, s_a = gdn_chunked(q[:37], k[:37], v[:37], g[:37], b[:37], s)
    o_b, s_b = gdn_chunked(q[37:], k[37:], v[37:], g[37:], b[37:], s_a)
    torch.testing.assert_close(torch.cat([o_a, o_b]), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_b, s_all, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T", [1, 2, 9, 33])
def test_gdn_states_after_every_token_equal_the_recurrence(T):
    """The fast per-token states (one block of the chunked form) against the recurrence run one
    token at a time, and the last against the chunked form's final state."""
    q, k, v, g, b, s = _gdn_inputs(T, seed=3)
    before = s.clone()
    o1, states1 = gdn_recurrent_states(q, k, v, g, b, s)
    o2, states2 = gdn_states(q, k, v, g, b, s)
    assert torch.equal(s, before) and states2.shape == (T,) + tuple(s.shape)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states2, states1, rtol=1e-10, atol=1e-10)
    for t in (0, T // 2, T - 1):
        _, alone = gdn_recurrent(q[:t + 1], k[:t + 1], v[:t + 1], g[:t + 1], b[:t + 1], s)
        assert torch.equal(states1[t], alone)
    torch.testing.assert_close(states2[-1], gdn_chunked(q, k, v, g, b, s)[1], rtol=1e-10, atol=1e-10)


def test_causal_conv_states_after_every_token():
    g = torch.Generator().manual_seed(1)
    x, state = torch.randn(6, 5, generator=g), torch.randn(3, 5, generator=g)
    w = torch.randn(5, 4, generator=g)
    y, each = causal_conv(x, state, w, each=True)
    assert torch.equal(y, causal_conv(x, state, w)[0]) and each.shape == (6, 3, 5)
    for t in range(6):
        assert torch.equal(each[t], causal_conv(x[:t + 1], state, w)[1])


def test_causal_conv_matches_definition_and_splits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y, state = causal_conv(x, torch.zeros(3, 5, dtype=torch.float64), w)
    for t in range(11):
        want = sum(w[:, j] * x[t - 3 + j] for j in range(4) if t - 3 + j >= 0)
        torch.testing.assert_close(y[t], want)
    torch.testing.assert_close(state, x[-3:])
    y1, s1 = causal_conv(x[:2], torch.zeros(3, 5, dtype=torch.float64), w)
    y2, s2 = causal_conv(x[2:], s1, w)
    torch.testing.assert_close(torch.cat([y1, y2]), y)
    torch.testing.assert_close(s2, state)


def _brute_select(scores, positions, top_k):
    picks = []
    for row, p in zip(scores.tolist(), positions.tolist()):
        visible = list(range(p + 1))
        if p + 1 <= top_k:
            picks.append(visible)
        else:
            picks.append(sorted(sorted(visible, key=lambda s: (-row[s], s))[:top_k]))
    return picks


@pytest.mark.parametrize("ties", [False, True])
def test_select_matches_brute_force_including_ties(ties):
    g = torch.Generator().manual_seed(4)
    S, top_k = 20, 5
    scores = torch.randn(8, S, generator=g)
    if ties:
        scores = torch.randint(0, 3, (8, S), generator=g).float()     # many exact ties
    positions = torch.tensor([0, 2, 4, 5, 9, 13, 17, 19])
    picked, valid = select(scores, positions, top_k)
    want = _brute_select(scores, positions, top_k)
    got = [[int(s) for s, ok in zip(r, v) if ok] for r, v in zip(picked, valid)]
    assert got == want


def test_index_scores_match_definition():
    g = torch.Generator().manual_seed(5)
    qi, iw, ki = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, generator=g), torch.randn(6, 4, generator=g)
    got = index_scores(qi, iw, ki)
    for t, s in itertools.product(range(3), range(6)):
        want = sum(iw[t, h] * 2 ** -0.5 * 4 ** -0.5 * torch.relu(qi[t, h] @ ki[s]) for h in range(2))
        torch.testing.assert_close(got[t, s], want)


def test_sparse_attention_matches_per_query_softmax():
    g = torch.Generator().manual_seed(6)
    T, S, hq, hkv, dh = 4, 9, 4, 2, 8
    q = torch.randn(T, hq, dh, generator=g, dtype=torch.float64)
    k = torch.randn(S, hkv, dh, generator=g, dtype=torch.float64)
    v = torch.randn(S, hkv, dh, generator=g, dtype=torch.float64)
    positions = torch.tensor([1, 4, 6, 8])
    picked, valid = select(torch.randn(T, S, generator=g, dtype=torch.float64), positions, 3)
    got = sparse_attention(q, k, v, picked, valid)
    for t in range(T):
        rows = [int(s) for s, ok in zip(picked[t], valid[t]) if ok]
        for h in range(hq):
            kv = h // 2
            w = torch.softmax(torch.stack([q[t, h] @ k[s, kv] / dh ** 0.5 for s in rows]), 0)
            torch.testing.assert_close(got[t, h], sum(w[i] * v[s, kv] for i, s in enumerate(rows)))


@pytest.mark.parametrize("ordered", [False, True])
def test_top_k_and_its_gap_match_their_definitions(ordered):
    g = torch.Generator().manual_seed(9)
    scores = torch.randint(0, 6, (40, 7), generator=g).double()          # many exact ties
    scores[::5, 3:] = float("-inf")                                       # rows with few candidates
    k = 3
    chosen, gap = top_k(scores, k), gaps(scores, k, ordered)
    for row, picked, d in zip(scores.tolist(), chosen.tolist(), gap.tolist()):
        live = sorted((s for s in range(7) if row[s] > float("-inf")), key=lambda s: (-row[s], s))
        assert picked[:min(k, len(live))] == live[:k]
        v = [row[s] for s in live]
        steps = [v[i] - v[i + 1] for i in range(min(k, len(v) - 1))]
        if ordered:
            want = min(steps, default=float("inf"))
        else:
            want = steps[k - 1] if len(v) > k else float("inf")
        assert d == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_top_k_chooses_what_the_stable_sort_chooses(dtype):
    """The selection on packed keys against its readable twin, on rows full of exact ties,
    signed zeros, infinities and NaNs, at every k: the same indices in the same order."""
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        T, N = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
        scores = (torch.randint(-4, 5, (T, N), generator=g).float() / 4).to(dtype)
        mark = torch.rand(T, N, generator=g)
        scores[mark < 0.05] = float("-inf")
        scores[(mark >= 0.05) & (mark < 0.08)] = -0.0
        scores[(mark >= 0.08) & (mark < 0.09)] = float("nan")
        scores[(mark >= 0.09) & (mark < 0.10)] = float("inf")
        for k in {1, min(N, 7), N, int(torch.randint(1, N + 1, (1,), generator=g))}:
            assert torch.equal(top_k_packed(scores, k), top_k_sorted(scores, k)), (trial, k)


def test_selection_over_a_long_row_matches_brute_force_with_ties():
    """`select` past PACK_FROM rows (where `top_k` packs) against the definition, with ties."""
    g = torch.Generator().manual_seed(12)
    S, top_k_ = PACK_FROM + 300, 64
    scores = torch.randint(0, 40, (3, S), generator=g).float()
    positions = torch.tensor([S - 1, S // 2, 30])
    picked, valid = select(scores, positions, top_k_)
    got = [[int(s) for s, ok in zip(r, v) if ok] for r, v in zip(picked, valid)]
    assert got == _brute_select(scores, positions, top_k_)


def test_route_ties_go_to_the_smaller_expert():
    w, idx = route(torch.tensor([[1.0, 3.0, 3.0, 3.0]]), 2)
    assert idx.tolist() == [[1, 2]]
    torch.testing.assert_close(w.sum(-1), torch.ones(1))


def test_grouped_experts_equal_per_token_experts():
    g = torch.Generator().manual_seed(7)
    T, D, E, I, k = 13, 16, 5, 8, 2
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, D, generator=g, dtype=torch.float64)
    down = torch.randn(E, D, I, generator=g, dtype=torch.float64)
    weights, experts = route(torch.randn(T, E, generator=g, dtype=torch.float64), k)
    torch.testing.assert_close(experts_grouped(h, weights, experts, gate_up, down),
                               experts_per_token(h, weights, experts, gate_up, down))


@pytest.mark.parametrize("T", [1, 13, 40])
def test_grouped_matmul_experts_equal_per_token_experts(T):
    """float32 (grouped_mm takes no float64); an expert no token chose is an empty range."""
    g = torch.Generator().manual_seed(T)
    D, E, I, k = 24, 6, 8, 2
    h = torch.randn(T, D, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g)
    down = torch.randn(E, D, I, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, 3] = -1e9                                  # expert 3 is never chosen
    weights, experts = route(logits, k)
    torch.testing.assert_close(experts_grouped_mm(h, weights, experts, gate_up, down),
                               experts_per_token(h, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


def test_ngram_hash_wraps_like_int64():
    consts = torch.tensor([[2**61 + 1, 3**38, 0], [2**60 + 7, 5**26, 7**21 + 2]], dtype=torch.int64)
    ids, history, buckets = torch.tensor([250, 3, 77, 1]), torch.tensor([256, 256]), (509, 1021)
    got = ngram_buckets(ids, history, consts, buckets)
    seq = [256, 256, 250, 3, 77, 1]
    for m in (2, 3):
        for t in range(4):
            acc = 0
            for j in range(m):
                acc ^= (seq[2 + t - j] * int(consts[m - 2, j])) % 2**64
            signed = acc - 2**64 if acc >= 2**63 else acc
            assert int(got[m - 2][t]) == signed % buckets[m - 2]


def test_sinkhorn_is_nearly_doubly_stochastic():
    comb = sinkhorn(torch.randn(6, 4, 4, dtype=torch.float64), 20, 1e-6)
    torch.testing.assert_close(comb.sum(-2), torch.ones(6, 4, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(6, 4, dtype=torch.float64), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_sinkhorn_matches_its_twin(dtype):
    """The CPU fast table's Sinkhorn rounds (numpy, in place) against `ops.hyper.sinkhorn`: one
    token and many, n a power of two and not, eps 0 too; the logits untouched; a dtype numpy
    lacks and a tensor that needs gradients take the twin itself."""
    from hebrus.ops.cpu import sinkhorn as on_cpu
    g = torch.Generator().manual_seed(3)
    bound = 1e-5 if dtype == torch.float32 else 1e-13     # 30 seeds here: 4e-7, 6e-16 at most
    for T, n, eps in itertools.product((1, 5, 300), (2, 3, 4, 8), (1e-6, 0.0)):
        logits = (3 * torch.randn(T, n, n, generator=g)).to(dtype)
        kept = logits.clone()
        got, want = on_cpu(logits, 20, eps), sinkhorn(logits, 20, eps)
        assert got.dtype == dtype and got.shape == want.shape
        assert float((got - want).abs().max()) <= bound, (T, n, eps)
        assert torch.equal(logits, kept)
    half = torch.randn(2, 4, 4, generator=g).bfloat16()
    assert torch.equal(on_cpu(half, 20, 1e-6), sinkhorn(half, 20, 1e-6))
    trained = torch.randn(2, 4, 4, generator=g, requires_grad=True)
    on_cpu(trained, 20, 1e-6).sum().backward()
    assert trained.grad is not None


def test_hc_pre_and_post_follow_their_formulas():
    g = torch.Generator().manual_seed(8)
    n, D = 4, 6
    X = torch.randn(2, n, D, generator=g, dtype=torch.float64)
    fn = torch.randn((2 + n) * n, n * D, generator=g, dtype=torch.float64)
    base, scale = torch.randn((2 + n) * n, generator=g, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    c, post, comb = hc_pre(X, fn, base, scale, 20, 1e-6, 1e-6)
    r = X.flatten(1) / (X.flatten(1).square().mean(-1, keepdim=True) + 1e-6).sqrt()
    pre = torch.sigmoid(scale[0] * (r @ fn.T)[:, :n] + base[:n]) + 1e-6
    torch.testing.assert_close(c, (pre[:, :, None] * X).sum(1))
    y = torch.randn(2, D, generator=g, dtype=torch.float64)
    out = hc_post(X, y, post, comb)
    for t, kk in itertools.product(range(2), range(n)):
        want = post[t, kk] * y[t] + sum(comb[t, j, kk] * X[t, j] for j in range(n))
        torch.testing.assert_close(out[t, kk], want)


def test_rope_rotates_pairs_and_keeps_norm():
    cos, sin = rope_tables(8, 10000.0, 32, torch.float64)
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    y = apply_rope(x, cos[5:8], sin[5:8])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    for t, i in itertools.product(range(3), range(4)):
        angle = (5 + t) * 10000.0 ** (-2 * i / 8)
        a, b = x[t, :, i], x[t, :, i + 4]
        torch.testing.assert_close(y[t, :, i], a * torch.cos(torch.tensor(angle, dtype=torch.float64)) - b * torch.sin(torch.tensor(angle, dtype=torch.float64)))


def test_grouped_matmul_experts_take_any_width():
    """Widths grouped_mm refuses (rows not a multiple of 16 bytes) still give the twin's result."""
    g = torch.Generator().manual_seed(1)
    T, D, E, I, k = 5, 3, 4, 1, 2
    h, gate_up = torch.randn(T, D, generator=g), torch.randn(E, 2 * I, D, generator=g)
    down = torch.randn(E, D, I, generator=g)
    weights, experts = route(torch.randn(T, E, generator=g), k)
    torch.testing.assert_close(experts_grouped_mm(h, weights, experts, gate_up, down),
                               experts_per_token(h, weights, experts, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, k", [(1, 1), (1, 2), (3, 2), (8, 2), (9, 2)])
def test_gathered_experts_equal_the_twin(T, k):
    """A few tokens' experts, each (token, choice) row with its own gathered matrices; the fast
    table sends at most 16 rows this way."""
    from hebrus.ops.moe import experts_few_first, experts_gathered
    g = torch.Generator().manual_seed(T * 10 + k)
    D, E, I = 6, 5, 3
    h, gate_up = torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(E, 2 * I, D, generator=g, dtype=torch.float64)
    down = torch.randn(E, D, I, generator=g, dtype=torch.float64)
    weights, experts = route(torch.randn(T, E, generator=g, dtype=torch.float64), k)
    want = experts_per_token(h, weights, experts, gate_up, down)
    torch.testing.assert_close(experts_gathered(h, weights, experts, gate_up, down), want, rtol=1e-12, atol=1e-12)
    calls = []
    runner = experts_few_first(lambda *a: calls.append(a) or want)
    runner(h, weights, experts, gate_up, down)
    assert bool(calls) == (T * k > 16)


def test_the_op_table_picks_kernels_by_device_and_dtype():
    from hebrus.layers.kernels import kernels
    from hebrus.ops.moe import experts_grouped, experts_grouped_mm
    cpu = torch.device("cpu")
    experts = "moe.experts"
    assert kernels("fast", None, cpu, torch.float32).ops[experts].many is experts_grouped_mm
    assert kernels("fast", None, cpu, torch.bfloat16).ops[experts].many is experts_grouped_mm
    assert kernels("fast", None, cpu, torch.float64).ops[experts].many is experts_grouped   # grouped_mm: no float64
    assert kernels("fast", None, cpu, torch.float32).ops[experts].few is experts_per_token   # a CPU reads routes for free
    assert kernels("exact", None, cpu, torch.float32).ops[experts] is experts_per_token


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("T, S", [(1, 1), (1, 9), (6, 6), (4, 11)])
def test_fused_dense_attention_equals_the_twin(dtype, tolerance, T, S):
    """One token, a first chunk (T = S), and a later chunk (positions S-T .. S-1), with 2 query
    heads per K/V head."""
    from hebrus.ops.qsa import dense_attention, dense_attention_chunk, dense_attention_rows, dense_attention_sdpa
    g = torch.Generator().manual_seed(T * 100 + S)
    q = torch.randn(T, 4, 8, generator=g, dtype=dtype)
    k, v = torch.randn(S, 2, 8, generator=g, dtype=dtype), torch.randn(S, 2, 8, generator=g, dtype=dtype)
    positions = torch.arange(S - T, S)
    want = dense_attention(q, k, v, positions)
    torch.testing.assert_close(dense_attention_sdpa(q, k, v, positions), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(dense_attention_rows(q, k, v, positions), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(dense_attention_chunk(q, k, v, positions), want, rtol=tolerance, atol=tolerance)
    # rows past every query's position are masked, whatever finite values they hold
    padded_k, padded_v = torch.cat([k, torch.randn(5, 2, 8, dtype=dtype)]), torch.cat([v, torch.zeros(5, 2, 8, dtype=dtype)])
    torch.testing.assert_close(dense_attention_rows(q, padded_k, padded_v, positions), want,
                               rtol=tolerance, atol=tolerance)


def test_the_recurrence_runs_several_sequences_at_once():
    """q [B, T, H, dk], state [B, H, dk, dv]: each sequence exactly as on its own."""
    from hebrus.ops.gdn import gdn_recurrent
    g = torch.Generator().manual_seed(3)
    B, T, H, dk, dv = 3, 2, 2, 4, 5
    q, k = torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dk, generator=g)
    v, gate, beta = torch.randn(B, T, H, dv, generator=g), -torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    o, S = gdn_recurrent(q, k, v, gate, beta, state)
    for i in range(B):
        oi, Si = gdn_recurrent(q[i], k[i], v[i], gate[i], beta[i], state[i])
        assert torch.equal(o[i], oi) and torch.equal(S[i], Si)


def test_ngram_buckets_hash_several_sequences_at_once():
    from hebrus.ops.ple import ngram_buckets
    g = torch.Generator().manual_seed(4)
    ids, history = torch.randint(0, 300, (3, 5), generator=g), torch.randint(0, 300, (3, 2), generator=g)
    constants, buckets = torch.randint(1, 2**40, (2, 3), generator=g), (97, 89)
    together = ngram_buckets(ids, history, constants, buckets)
    for i in range(3):
        alone = ngram_buckets(ids[i], history[i], constants, buckets)
        assert all(torch.equal(a[i], b) for a, b in zip(together, alone))


@pytest.mark.parametrize("ties", [False, True])
def test_sparse_attention_equals_dense_attention_masked_to_the_selection(ties):
    """Past the top-k, over a long row log: attention over the picked rows is dense attention
    with every other row masked out (the same selections), ties in the scores included."""
    g = torch.Generator().manual_seed(11)
    T, S, hq, hkv, dh, top_k = 6, 3000, 4, 2, 16, 64
    q = torch.randn(T, hq, dh, generator=g, dtype=torch.float64)
    k = torch.randn(S, hkv, dh, generator=g, dtype=torch.float64)
    v = torch.randn(S, hkv, dh, generator=g, dtype=torch.float64)
    positions = torch.tensor([10, 63, 64, 700, 2500, S - 1])
    scores = (torch.randint(0, 4, (T, S), generator=g) if ties else torch.randn(T, S, generator=g)).double()
    picked, valid = select(scores, positions, top_k)
    assert int(valid.sum(-1).min()) == 11 and int(valid.sum(-1).max()) == top_k
    got = sparse_attention(q, k, v, picked, valid)
    chosen = torch.zeros(T, S, dtype=torch.bool)
    chosen[torch.arange(T)[:, None].expand_as(picked)[valid], picked[valid]] = True
    logits = torch.einsum("thd,shd->ths", q, k.repeat_interleave(hq // hkv, dim=1)) * dh ** -0.5
    weights = torch.softmax(logits.masked_fill(~chosen[:, None, :], float("-inf")), -1)
    want = torch.einsum("ths,shd->thd", weights, v.repeat_interleave(hq // hkv, dim=1))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dense_attention_of_lanes_is_each_lane_alone():
    """N sessions' single queries, each over its rows read through its own block table (blocks
    scattered through a pool, one shared by two lanes), against `dense_attention` of each."""
    from hebrus.ops.qsa import dense_attention, dense_attention_lanes
    g = torch.Generator().manual_seed(0)
    N, hq, hkv, dh, R, W = 5, 8, 2, 16, 8, 5
    k_blocks, v_blocks = (torch.randn(30, R, hkv, dh, generator=g, dtype=torch.float64) for _ in range(2))
    tables = torch.randperm(30, generator=g)[:N * W].view(N, W)
    tables[3, 0] = tables[1, 0]                                        # a block two lanes share
    q = torch.randn(N, hq, dh, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 5, 39, 20, 7])
    got = dense_attention_lanes(q, k_blocks, v_blocks, tables, positions)
    k, v = (b[tables].flatten(1, 2) for b in (k_blocks, v_blocks))    # each lane's rows [N, W * R, ...]
    want = torch.stack([dense_attention(q[i:i + 1], k[i], v[i], positions[i:i + 1])[0] for i in range(N)])
    assert float((got - want).abs().max()) <= 1e-12


def test_a_fused_ops_shared_kernel_serves_every_length_and_never_the_lanes():
    """The form shared by every length is made once, with the rows symbolic, and answers
    each later length without compiling again, a power of two of rows too outside a planned
    step; within one (`planned()`) a lanes' shape compiles its own kernel even after the shared
    one exists (torch.compile shares kernels between compilers that compare equal, which is
    why the two forms' options differ); the caller's tensors stay unmarked. Compiled here by
    the CPU's inductor: the same caching as on CUDA."""
    from torch._dynamo.utils import counters

    from hebrus.ops.cuda.fuse import _Fused, planned
    from hebrus.ops.moe import silu_mul
    torch._dynamo.reset()
    op = _Fused(silu_mul)
    g = torch.Generator().manual_seed(5)
    made = []
    for T, lanes in ((5, False), (300, False), (64, False), (7, False), (64, True), (64, True), (9, False),
                     (64, False), (9, True)):
        both = torch.randn(T, 2 * 24, generator=g)         # gate and up side by side, as the products give them
        gate, up = both[:, :24], both[:, 24:]
        before = counters["stats"]["unique_graphs"]
        with planned() if lanes else contextlib.nullcontext():
            got = op(gate, up)
        made.append(counters["stats"]["unique_graphs"] - before)
        assert op.failed is None, op.failed
        assert torch.allclose(got, silu_mul(gate, up), rtol=1e-6, atol=1e-6)
        assert not any(hasattr(t, "_dynamo_weak_dynamic_indices") for t in (both, gate, up))
    assert made == [1, 0, 0, 0, 1, 0, 0, 0, 0]


def _conv_of(x, state, weight):
    """An op over a state, as the delta rule's inputs take the conv's (`fresh`: its state)."""
    from hebrus.ops.conv import causal_conv
    return causal_conv(x, state, weight)


_conv_of.fresh = (1,)


@pytest.mark.parametrize("fresh", [True, False])
def test_a_fused_ops_fresh_state_compiles_once_wherever_it_lies(fresh):
    """A state read where its slot lies (a transposed view at the slot's offset, of a tensor
    made outside inference mode), one of several stacked, and the one a call before left (an
    inference tensor of its own) meet one compiled kernel when the op names the state `fresh`;
    without, the compiler's guards on layout, offset and kind of tensor fail and it compiles
    again (on a server: seconds while every request waited). Compiled here by the CPU's inductor."""
    from torch._dynamo.utils import counters

    from hebrus.ops.cuda.fuse import _Fused
    torch._dynamo.reset()

    def op(x, state, weight):
        return _conv_of(x, state, weight)
    op.fresh = (1,) if fresh else ()
    fused = _Fused(op)
    g = torch.Generator().manual_seed(11)
    C, K = 8, 4
    weight = torch.randn(C, K, generator=g)
    pool = torch.randn(5, C, K - 1, generator=g)          # slots of [C, K-1], read transposed
    made = []
    with torch.inference_mode():
        stacked = torch.randn(3, K - 1, C, generator=g)
        state = pool[2].transpose(0, 1)
        for T, source in ((9, "slot"), (17, "left"), (33, "stacked"), (12, "slot"), (10, "left")):
            if source == "slot":
                state = pool[3 if T == 12 else 2].transpose(0, 1)
            elif source == "stacked":
                state = stacked[1]
            x = torch.randn(T, C, generator=g)
            before = counters["stats"]["unique_graphs"]
            y, new = fused(x, state, weight)
            made.append(counters["stats"]["unique_graphs"] - before)
            want_y, want_state = _conv_of(x, state, weight)
            assert fused.failed is None, fused.failed
            assert torch.allclose(y, want_y, rtol=1e-5, atol=1e-5) and torch.allclose(new, want_state)
            state = new
    if fresh:
        assert made == [1, 0, 0, 0, 0], made
    else:
        assert sum(made) > 1, made          # what the test guards against happens without it


def test_the_fused_ngram_hashes_are_the_same_ids():
    """`ngram_buckets` compiled (here by the CPU's inductor) gives the ids as written, exactly:
    int64 products that wrap around, XOR, and a remainder of negative values, for a chunk, a
    lanes' shape and sessions' single tokens with their own histories."""
    from hebrus.ops.cuda.fuse import _Fused
    from hebrus.ops.ple import ngram_buckets
    torch._dynamo.reset()
    op = _Fused(ngram_buckets)
    g = torch.Generator().manual_seed(7)
    constants = torch.randint(-2**62, 2**62, (2, 3), generator=g)
    for ids, history in ((torch.randint(0, 256, (5,), generator=g), torch.randint(0, 256, (2,), generator=g)),
                         (torch.randint(0, 256, (8,), generator=g), torch.randint(0, 256, (2,), generator=g)),
                         (torch.randint(0, 256, (4, 1), generator=g), torch.randint(0, 256, (4, 2), generator=g))):
        got, want = op(ids, history, constants, (1021, 2039)), ngram_buckets(ids, history, constants, (1021, 2039))
        assert op.failed is None, op.failed
        assert len(got) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(0 <= int(a.min()) and int(a.max()) < size for a, size in zip(got, (1021, 2039)))


def test_fused_ops_specialise_exactly_the_lanes_shapes():
    """A compiled op gets a kernel of its own for a power of two of rows up to STATIC_ROWS (a
    planned step's lanes) and shares one for every other length; decided by the shapes alone."""
    from hebrus.ops.cuda.fuse import STATIC_ROWS, static_shape
    lanes = [1, 2, 8, 64, 256, STATIC_ROWS]
    assert all(static_shape((torch.zeros(n, 3), 1e-6)) for n in lanes)
    assert not any(static_shape((torch.zeros(n, 3),)) for n in (0, 3, 63, 100, 2 * STATIC_ROWS, 2048))
    assert not static_shape((torch.tensor(1.0),)) and not static_shape((1.0, torch.zeros(64)))


@pytest.mark.parametrize("lengths", [(1,), (3, 1, 7), (1, 1, 1, 1), (5, 17, 2)])
@pytest.mark.parametrize("k", [2, 4])
def test_a_ragged_causal_conv_is_each_sequence_alone(lengths, k):
    """`causal_conv_ragged` over sequences laid end to end (`StepBatch.windows`) gives each
    sequence's outputs and new state bit for bit as `causal_conv` of it alone: no window reaches
    past its own sequence's state."""
    from hebrus.ops.conv import causal_conv, causal_conv_ragged
    from hebrus.state.step import windows
    g = torch.Generator().manual_seed(sum(lengths) + k)
    C = 6
    x = torch.randn(sum(lengths), C, generator=g)
    states = torch.randn(len(lengths), k - 1, C, generator=g)
    weight = torch.randn(C, k, generator=g)
    y, new = causal_conv_ragged(x, states, weight, windows(lengths, k, x.device))
    start = 0
    for i, n in enumerate(lengths):
        want_y, want_state = causal_conv(x[start:start + n], states[i], weight)
        assert torch.equal(y[start:start + n], want_y) and torch.equal(new[i], want_state), (i, n)
        start += n
