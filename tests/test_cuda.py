"""The CUDA route against the CPU reference: fla's gated delta rule against the readable twins,
and verify on CUDA for the tiny preset and a tiny Qwen3.5. Skipped where there is no CUDA device
or no fla (CI); run on the device machine, results in benchmarks/results/cuda-h200/."""
from __future__ import annotations

import pytest
import torch

import hebrus
from conftest import poisoned as with_nan_row
from hebrus.ops.gdn import gdn_chunked, gdn_recurrent

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fla():
    from hebrus.ops.cuda import gdn
    if not gdn.available():
        pytest.skip("needs fla (pip install hebrus[cuda])")
    return gdn.gdn_fla


def _inputs(T, H, dk, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=gen), dim=-1)
    v = torch.randn(T, H, dv, generator=gen)
    g = -torch.rand(T, H, generator=gen) * 2
    beta = torch.rand(T, H, generator=gen)
    state = torch.randn(H, dk, dv, generator=gen) * 0.1
    cpu = (q, k, v, g, beta, state)
    gpu = tuple(t.cuda() for t in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta, state))
    return cpu, gpu


def _rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / b.double().abs().max())


@cuda
@pytest.mark.parametrize("T", [1, 64, 200])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])   # fla: TF32 dots
def test_fla_delta_rule_matches_the_twins(T, dtype, tolerance):
    fla = _fla()
    cpu, gpu = _inputs(T, 4, 64, 128, dtype)                       # dk != dv: a layout swap would show
    rounded = tuple(t.to(dtype).double() if i < 3 else t.double() for i, t in enumerate(cpu))
    want_o, want_s = (gdn_recurrent if T == 1 else gdn_chunked)(*rounded)
    before = gpu[-1].clone()
    o, s = fla(*gpu)
    assert torch.equal(gpu[-1], before), "the state passed in must stay untouched"
    assert o.shape == want_o.shape and s.shape == want_s.shape and s.dtype == torch.float32
    assert _rel(o, want_o) <= tolerance
    assert _rel(s, want_s) <= tolerance


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_verify_passes_on_cuda(dtype, mode):
    """In bfloat16 fast mode the delta rule runs through fla (when installed)."""
    from hebrus import verify
    from hebrus.ops.cuda import gdn
    model = hebrus.load("tiny", device="cuda", dtype=dtype, mode=mode)
    if mode == "fast" and dtype == "bfloat16" and gdn.available():
        assert model.kernels.ops["gdn.delta_rule"] is gdn.gdn_fla
    failed = [r for r in verify.run(model) if not r.passed]
    assert not failed, [(r.name, r.detail) for r in failed]


@cuda
@pytest.mark.parametrize("T", [1, 40])
def test_grouped_matmul_experts_on_cuda_match_the_twin(T):
    from hebrus.ops.moe import experts_grouped_mm, experts_per_token, grouped_mm_supports, route
    if not grouped_mm_supports(torch.device("cuda"), torch.bfloat16):
        pytest.skip("grouped_mm needs bfloat16 on compute capability 9.0")
    g = torch.Generator().manual_seed(T)
    D, E, I, k = 64, 8, 32, 2
    h, gate_up, down = (torch.randn(*s, generator=g) for s in ((T, D), (E, 2 * I, D), (E, D, I)))
    weights, experts = route(torch.randn(T, E, generator=g), k)
    want = experts_per_token(h.double(), weights.double(), experts, gate_up.double(), down.double())
    inputs = tuple(t.cuda() for t in (h.bfloat16(), weights, experts, gate_up.bfloat16(), down.bfloat16()))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")                        # any host synchronisation raises
    try:
        got = experts_grouped_mm(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _rel(got, want) <= 3e-2


# ---- CUDA-graph decode ------------------------------------------------------------------------

def _graph_models(tmp_path):
    """The models the graph tests run."""
    from foreign import build
    folder, _ = build("qwen3_5", tmp_path / "qwen3_5")
    return {"tiny-float32": hebrus.load("tiny", device="cuda", mode="fast"),
            "tiny-bfloat16": hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast"),
            "qwen3_5-bfloat16": hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast")}


def _ids(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _graph_steps_near_eager(model, prompt, tokens):
    """A 16-bit model's graph decode over `prompt` then `tokens`, one at a time: its steps are
    its plan's, bit for bit (logits every step, the digest at the end), and no farther from the
    same weights run in float32 than eager 16-bit steps are: over the steps, the median distance
    of the graph's logits from float32's at most twice eager's (+1e-3), each measured on the
    card it runs on. The two 16-bit routes round differently (the lanes' kernels keep the conv,
    q, k and v in float32 where eager rounds them to 16 bits; attention reads every row of the
    tables, masked), so their distance from each other is rounding's own scale, which differs
    by model and card (the tiny Qwen3.5 at 1-2.5% median on the H100 and the H200, the tiny
    preset at 1%): no fixed bound on it holds everywhere. A wrong kernel moves every step far
    from float32; a flip at a near-tie (a random 16-bit model's experts and attended rows lie
    near ties: `benchmarks/diag/graph_flips.py`) moves a few, which the median passes over.
    -> the graph session (its runner's counts)."""
    graph, planned, eager = (model.session(decode=d) for d in ("graph", "planned", "eager"))
    wide = model.with_dtype(torch.float32).session(decode="eager")
    for s in (graph, planned, eager, wide):
        s.feed(prompt)
    far: dict[str, list[float]] = {"graph": [], "eager": []}
    for step, t in enumerate(tokens):
        a, want = graph.feed([t]), wide.feed([t])
        assert torch.equal(a, planned.feed([t])), step
        far["graph"].append(_rel(a.float(), want))
        far["eager"].append(_rel(eager.feed([t]).float(), want))
    assert graph.digest() == planned.digest()
    median = {route: sorted(d)[len(d) // 2] for route, d in far.items()}
    assert median["graph"] <= 2 * median["eager"] + 1e-3, (median, far)
    return graph


@cuda
def test_graph_decode_matches_eager(tmp_path):
    """Graph replays against eager steps on the same device, storage growth (rows 16 and 32)
    replayed from the same graph. float32: every step's logits and, at the end, every owner
    within 1e-4 of eager's, discrete state equal. A 16-bit model: `_graph_steps_near_eager`."""
    for name, model in _graph_models(tmp_path).items():
        vocab = model.spec.vocab_size
        prompt, tokens = _ids(10, vocab, 1), _ids(30, vocab, 2)
        if model.dtype != torch.float32:
            steps = _graph_steps_near_eager(model, prompt, tokens)._steps
            assert steps.captures >= 1 and steps.replays >= 20, (name, steps.captures, steps.replays, steps.refused)
            continue
        graph, eager = model.session(decode="graph"), model.session(decode="eager")
        for s in (graph, eager):
            s.feed(prompt)
        for step, t in enumerate(tokens):
            a, b = graph.feed([t]), eager.feed([t])
            assert _rel(a.float(), b.float()) <= 1e-4, (name, step, _rel(a.float(), b.float()))
        steps = graph._steps
        assert steps.captures >= 1 and steps.replays >= 20, (name, steps.captures, steps.replays, steps.refused)
        for spec in graph.image.specs:
            a, b = graph.image.value(spec.name), eager.image.value(spec.name)
            if a.is_floating_point():
                assert _rel(a.float(), b.float()) <= 1e-4 or float(b.abs().max()) == 0, (name, spec.name)
            else:
                assert torch.equal(a, b), (name, spec.name)


@cuda
def test_graph_step_failures_publish_nothing(tmp_path):
    """A real NaN inside a replayed graph and a device-side range failure inside one abort the
    step with the digest unchanged and `out` untouched; the session then goes on."""
    from hebrus.errors import DeviceStatusError, NonFiniteError
    model = _graph_models(tmp_path)["qwen3_5-bfloat16"]
    bad, vocab = 5, model.spec.vocab_size
    poisoned = with_nan_row(model, bad)
    s = poisoned.session()
    assert s.decode == "graph"
    s.feed([t if t != bad else bad + 1 for t in _ids(10, vocab, 1)])
    for t in (1, 2, 3):                              # warm the plan, capture it, replay it
        s.feed([t])
    assert s._steps.replays >= 1
    before, out = s.digest(), torch.full((vocab,), 7.0, device="cuda", dtype=model.dtype)
    with pytest.raises(NonFiniteError):
        s.feed([bad], out=out)
    assert s.digest() == before and bool((out == 7.0).all())
    with pytest.raises(DeviceStatusError, match="token_range"):
        with torch.inference_mode():
            s._run(torch.tensor([vocab + 3]), None)
    assert s.digest() == before
    replays = s._steps.replays
    assert torch.isfinite(s.feed([4]).float()).all() and s._steps.replays == replays + 1


@cuda
def test_real_cuda_out_of_memory_aborts_the_chunk(tmp_path):
    """With the device's memory taken, a chunk's allocation really fails: AllocationError, the
    digest unchanged; once memory is free again the same chunk publishes."""
    from hebrus.errors import AllocationError
    model = _graph_models(tmp_path)["qwen3_5-bfloat16"]
    s = model.session()
    s.feed(_ids(10, model.spec.vocab_size, 1))
    before, chunk = s.digest(), _ids(200, model.spec.vocab_size, 3)
    torch.cuda.empty_cache()
    filler = []
    for size in (1 << 30, 1 << 26, 1 << 21, 1 << 16):
        while True:
            try:
                filler.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    try:
        with pytest.raises(AllocationError):
            s.feed(chunk)
    finally:
        filler.clear()
        torch.cuda.empty_cache()
    assert s.digest() == before
    s.feed(chunk)
    assert s.frontier == 210


@cuda
def test_finite_checks_see_nan_and_inf_on_cuda():
    """The multi-tensor max-magnitude reduction behind the finite checks propagates NaN on CUDA."""
    from hebrus.state.status import DeviceChecks
    checks = DeviceChecks()
    values = [torch.randn(100000, device="cuda"), torch.randn(3000, device="cuda", dtype=torch.bfloat16),
              torch.full((5,), 1e38, device="cuda")]
    values[0][77777] = float("nan")
    values[1][5] = float("inf")
    for cell, t in enumerate(values):
        checks.finite(cell, [(t, None)])
    assert checks.read()[0][1] == {0, 1}
    several = DeviceChecks(defer=True, lengths=[1] * 4)      # rows of a session each, reduced together
    rows = [torch.randn(4, 3000, device="cuda", dtype=dtype) for dtype in (torch.float32, torch.bfloat16,
                                                                            torch.float16, torch.bfloat16)]
    rows[0][1, 2999], rows[1][3, 0], rows[3][3, 7] = float("nan"), float("-inf"), float("nan")
    for cell, t in enumerate(rows):
        several.finite(cell, [(t, None)])
    assert [nonfinite for _, nonfinite in several.read()] == [set(), {0}, set(), {1, 3}]
    from hebrus.state.status import _row_norm_keeps_nan
    ragged = DeviceChecks(lengths=[300, 1, 2000, 7])         # rows of a token each, by session at the fold
    tokens = [torch.randn(2308, 2048, device="cuda", dtype=dtype) for dtype in (torch.bfloat16, torch.float32,
                                                                                torch.bfloat16)]
    tokens[0][300, 1000], tokens[1][2303, 5], tokens[2][299, 2047] = float("nan"), float("inf"), float("nan")
    for cell, t in enumerate(tokens):
        ragged.finite(cell, [(t, None)])
    assert _row_norm_keeps_nan(torch.device("cuda"))
    assert [nonfinite for _, nonfinite in ragged.read()] == [{2}, {0}, set(), {1}]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37, 64])
def test_fused_ops_equal_their_twins(dtype, T):
    """Each op the CUDA fast table compiles, against the op as written on the same inputs."""
    from hebrus.ops.cuda.fuse import fused
    from hebrus.ops.gdn import gdn_inputs
    from hebrus.ops.hyper import hc_gates, hc_head, hc_post, hc_pre
    from hebrus.ops.moe import route_weights, router_probs, sigmoid_gated_add, silu_mul
    from hebrus.ops.norm import add_rms_norm, gated_rms_norm, rms_norm
    from hebrus.ops.ple import gelu_mul, ngram_buckets
    from hebrus.ops.qsa import sigmoid_gated
    from hebrus.ops.rope import apply_rope, normed_rotated, rope_tables
    g = torch.Generator(device="cuda").manual_seed(T)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dt)

    cos, sin = (t[:T] for t in rope_tables(16, 10000.0, 64, torch.float32, "cuda"))
    n, D, f32 = 3, 32, torch.float32
    X = r(T, n, D)
    C = 2 * 2 * 16 + 4 * 8
    projected, _, b, a = r(T, C + 16 + 4 + 4).split([C, 16, 4, 4], dim=1)
    cases = [
        (rms_norm, (r(T, D), r(D, dt=f32), 1e-6)),
        (add_rms_norm, (r(T, 1, D), r(T, D), r(D, dt=f32), 1e-6)),
        (gated_rms_norm, (r(T, 4, 16), r(T, 4, 16), r(16, dt=f32), 1e-6)),
        (gated_rms_norm, (r(T, 4, 16, dt=f32), r(T, 4, 16), r(16, dt=f32), 1e-6)),     # o as the delta rule gives it
        (gdn_inputs, (r(T, C), r(T, 4), r(T, 4), r(3, C), r(C, 4), -r(4, dt=f32).abs(), r(4, dt=f32), (2, 16, 4, 8))),
        # the same from slices of one product's columns, the conv state transposed as the bank holds it
        (gdn_inputs, (projected, b, a, r(C, 3).transpose(0, 1), r(C, 4), -r(4, dt=f32).abs(), r(4, dt=f32),
                      (2, 16, 4, 8))),
        (normed_rotated, (r(T, 4, 16), r(16, dt=f32), cos, sin, 1e-6)),
        (apply_rope, (r(T, 4, 16), cos, sin)),
        (sigmoid_gated, (r(T, 4, 16), r(T, 4, 16))),
        (silu_mul, (r(T, 64), r(T, 64))),
        (gelu_mul, (r(T, 64), r(T, 64))),
        (ngram_buckets, (torch.randint(0, 256, (T,), generator=g, device="cuda"),
                         torch.randint(0, 256, (2,), generator=g, device="cuda"),
                         torch.randint(-2**62, 2**62, (2, 3), generator=g, device="cuda"), (1021, 2039))),
        (sigmoid_gated_add, (r(T, 32), r(T, 1), r(T, 32))),
        (router_probs, (r(T, 8),)),
        (route_weights, (r(T, 8, dt=f32).softmax(-1), torch.randint(0, 8, (T, 2), generator=g, device="cuda"), True)),
        (hc_pre, (X, r((2 + n) * n, n * D, dt=f32), r((2 + n) * n, dt=f32), r(3, dt=f32).abs(), 20, 1e-6, 1e-6)),
        (hc_gates, (X, r((2 + n) * n, n * D, dt=f32), r((2 + n) * n, dt=f32), r(3, dt=f32).abs(), 1e-6, 1e-6)),
        (hc_post, (X, r(T, D), r(T, n, dt=f32), r(T, n, n, dt=f32).softmax(-1))),
        (hc_head, (X, r(n, n * D, dt=f32), r(n, dt=f32), r(3, dt=f32).abs(), 1e-6, 1e-6)),
    ]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for op, args in cases:
        with torch.inference_mode():
            want, got = op(*args), fused(op)(*args)
        assert fused(op).failed is None, (op.__name__, fused(op).failed)
        want, got = (tuple(w) if isinstance(w, (tuple, list)) else (w,) for w in (want, got))
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, op.__name__
            if not a.is_floating_point():                   # integer ops: the same values
                assert torch.equal(a, b), op.__name__
                continue
            assert _rel(a.float(), b.float()) <= tolerance, op.__name__


@cuda
def test_a_fused_op_gives_the_same_bits_whatever_it_compiled_before():
    """The same inputs through a compiled op give the same bits before and after it has met
    other chunk lengths (the compiler's default would keep a kernel specialised to the first
    length and then use its general one for that length too: float32 verify saw other bits)."""
    from hebrus.ops.cuda.fuse import _Fused
    from hebrus.ops.hyper import hc_pre
    from hebrus.ops.norm import rms_norm
    g = torch.Generator(device="cuda").manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    n, D = 4, 512
    weights = (r((2 + n) * n, n * D), r((2 + n) * n), r(3).abs())
    torch._dynamo.reset()          # compiled code lives on the op's code object: start from none
    for op, make in ((rms_norm, lambda T: (r(T, D), r(D), 1e-6)),
                     (hc_pre, lambda T: (r(T, n, D), *weights, 20, 1e-6, 1e-6))):
        for rows in (7, 64):                      # a length of the shared kernel, a lanes' length
            fresh, first = _Fused(op), make(rows)
            with torch.inference_mode():
                before = fresh(*first)
                for T in (9, 300, 2, 1, 64, 2048):
                    fresh(*make(T))
                after = fresh(*first)
            for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (before, after))):
                assert torch.equal(a, b), (op.__name__, rows)


@cuda
@pytest.mark.parametrize("n, eps", [(1, 1e-6), (3, 1e-6), (4, 1e-6), (5, 1e-6), (16, 1e-6), (3, 0.0), (7, 0.0)])
def test_the_sinkhorn_kernel_matches_its_twin_and_each_token_alone(n, eps):
    """The Triton Sinkhorn rounds against `ops.hyper.sinkhorn` (n not a power of two too, and
    eps 0, which a checkpoint may set: the padding must never divide 0 by 0), and a token's mix
    the same bits alone as among others (the sums never cross tokens)."""
    from hebrus.ops.cuda.sinkhorn import sinkhorn
    from hebrus.ops.hyper import sinkhorn as twin
    g = torch.Generator(device="cuda").manual_seed(n)
    logits = 3 * torch.randn(70, n, n, generator=g, device="cuda")
    got = sinkhorn(logits, 20, eps)
    assert got.shape == logits.shape and got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert _rel(got.double(), twin(logits.double(), 20, eps)) <= 1e-5
    for rows in (slice(5, 6), slice(31, 40)):
        assert torch.equal(sinkhorn(logits[rows], 20, eps), got[rows])
    assert sinkhorn(logits[:0], 20, eps).shape == (0, n, n)
    assert torch.equal(sinkhorn(logits.double(), 20, eps), twin(logits.double(), 20, eps))     # float64: the twin


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B, V, W", [(1, 151936, 4748), (64, 151936, 4748), (3, 1000, 20), (2, 70, 3), (0, 64, 2)])
def test_the_mask_kernel_equals_its_twin(dtype, B, V, W):
    """`ops.cuda.masks.masked` against `sampling.masked`, bit for bit: every bit of a word (the
    sign bit too), masks shorter than the vocabulary (tokens past them not allowed) and longer,
    logits of -inf, +inf and NaN kept where allowed; rows that are a view of a wider tensor;
    and `constrained`, which takes the kernel on CUDA, against the twin on the CPU."""
    from hebrus.ops.cuda.masks import masked
    from hebrus.sampling import constrained, masked as twin
    g = torch.Generator().manual_seed(B + V)
    rows = torch.randn(B, V + 5, generator=g).to(dtype)
    rows[:, 3], rows[:, 4], rows[:, 5] = float("-inf"), float("inf"), float("nan")
    words = torch.randint(-(1 << 31), 1 << 31, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
    if B:
        words[0, 0] = -(1 << 31)                # the sign bit alone: token 31 only
    rows_d, words_d = rows.cuda()[:, :V], words.cuda()
    got = masked(rows_d, words_d)
    assert got.shape == (B, V) and got.dtype == dtype
    if B:
        assert torch.equal(got.isnan(), twin(rows_d, words_d).isnan())
        assert torch.equal(got.nan_to_num(7.0), twin(rows_d, words_d).nan_to_num(7.0))
        on_cpu = constrained(rows[:, :V], list(words))
        assert torch.equal(constrained(rows_d, list(words)).cpu().nan_to_num(7.0), on_cpu.nan_to_num(7.0))


@cuda
@pytest.mark.parametrize("T, S", [(1, 300), (16, 300), (64, 64), (200, 1000)])
def test_dense_attention_fast_on_cuda_matches_the_twin(T, S):
    """Fast mode's dense attention in bfloat16 with grouped K/V heads of 256 features (the
    1.68B shape): the row form for a few queries, the bottom-right causal chunk form for more."""
    from hebrus.ops.qsa import dense_attention, dense_attention_fast
    g = torch.Generator().manual_seed(T + S)
    q, k, v = torch.randn(T, 8, 256, generator=g), torch.randn(S, 2, 256, generator=g), torch.randn(S, 2, 256, generator=g)
    positions = torch.arange(S - T, S)
    want = dense_attention(q.double(), k.double(), v.double(), positions)
    got = dense_attention_fast(*(t.cuda().bfloat16() for t in (q, k, v)), positions.cuda())
    assert _rel(got.float(), want) <= 2e-2


@cuda
def test_qsa_selection_on_cuda_is_the_cpus():
    """The indexer's top-k on the GPU picks the very rows the CPU picks from the same scores,
    ties (made on purpose) going to the smaller row on both."""
    from hebrus.ops.qsa import select
    g = torch.Generator().manual_seed(5)
    T, S, k = 40, 300, 16
    scores = torch.randn(T, S, generator=g).round(decimals=1)       # many exact ties
    positions = torch.arange(S - T, S)
    cpu = select(scores, positions, k)
    gpu = select(scores.cuda(), positions.cuda(), k)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


@cuda
def test_fla_runs_several_sessions_tokens_at_once():
    """A batch of sessions' single tokens through fla's fused recurrence, against the twin."""
    fla = _fla()
    cpu, _ = _inputs(6, 4, 64, 128, torch.bfloat16)                 # 6 "sessions" of one token
    q, k, v, g, beta = (t[:, None] for t in cpu[:5])
    state = torch.randn(6, 4, 64, 128, generator=torch.Generator().manual_seed(1)) * 0.1
    rounded = [t.to(torch.bfloat16).double() if i < 3 else t.double() for i, t in enumerate((q, k, v, g, beta))]
    want_o, want_s = gdn_recurrent(*rounded, state.double())
    got_o, got_s = fla(*(t.cuda().to(torch.bfloat16) if i < 3 else t.cuda() for i, t in enumerate((q, k, v, g, beta))),
                       state.cuda())
    assert got_o.shape == want_o.shape and got_s.shape == want_s.shape
    assert _rel(got_o, want_o) <= 3e-2 and _rel(got_s, want_s) <= 3e-2


@cuda
def test_fla_runs_sessions_chunks_of_any_lengths_in_one_call():
    """N sequences of different lengths through fla's varlen form (cu_seqlens), against each
    sequence through fla alone (which itself matches the twins, above)."""
    from hebrus.ops.cuda.gdn import gdn_fla_ragged
    fla = _fla()
    bounds = (0, 5, 6, 70, 71, 200)
    cpu, gpu = _inputs(bounds[-1], 4, 64, 128, torch.bfloat16)
    states = torch.randn(len(bounds) - 1, 4, 64, 128, generator=torch.Generator().manual_seed(2)).cuda() * 0.1
    cu = torch.tensor(bounds, device="cuda")
    o, s = gdn_fla_ragged(*gpu[:5], states, cu, bounds)
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        want_o, want_s = fla(*(t[a:b] for t in gpu[:5]), states[i])
        assert _rel(o[a:b], want_o) <= 1e-2 and _rel(s[i], want_s) <= 1e-2, i


@cuda
def test_the_varlen_inputs_made_on_the_host_are_flas_own_and_made_once_for_each_set_of_bounds():
    """`varlen`'s chunk list (made on the host, so fla never waits for the device to make it)
    is what fla makes from the bounds on the device, at lengths below, at and past a chunk; the
    same bounds give the same tensors (fla's caches know them by identity)."""
    _fla()
    from fla.ops.utils import prepare_chunk_indices
    from hebrus.ops.cuda.gdn import CHUNK, varlen
    for bounds in [(0, 1), (0, 64), (0, 65), (0, 5, 6, 70, 71, 200), (0, 1, 2, 3), (0, 128, 129, 300)]:
        on_device, on_host, chunks = varlen(bounds, torch.device("cuda"))
        assert on_device.dtype == torch.int64 and on_host.tolist() == list(bounds) == on_device.tolist()
        assert torch.equal(chunks, prepare_chunk_indices(torch.tensor(bounds, device="cuda"), CHUNK)), bounds
        assert all(a is b for a, b in zip(varlen(bounds, torch.device("cuda")), (on_device, on_host, chunks)))


@cuda
def test_ragged_steps_on_cuda_match_the_sessions_fed_alone(tmp_path):
    """Prompts beside decode tokens in one step of a bfloat16 Qwen3.5 on CUDA (fla's varlen
    delta rule) against each session fed alone: both are bfloat16 roundings of the same values,
    so each is held to a float32 model of the same weights, the sessions stepped together no
    further from it than a few times the sessions fed alone (a 16-bit random model amplifies a
    difference in where it rounds past any fixed bound between the two)."""
    from foreign import build
    folder, _ = build("qwen3_5", tmp_path)
    model = hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast")
    exact = hebrus.load(folder, device="cuda", dtype="float32", mode="fast")
    together, alone, reference = ([m.session(decode="eager") for _ in range(4)] for m in (model, model, exact))
    gen = torch.Generator().manual_seed(3)
    for a, b, r, n in zip(together, alone, reference, (3, 17, 1, 30)):
        ids = torch.randint(0, model.spec.vocab_size, (n,), generator=gen).tolist()
        a.feed(ids)
        b.feed(ids)
        r.feed(ids)
    for lengths in [(9, 1, 40, 1), (1, 1, 1, 1), (2, 33, 1, 5)]:
        chunks = [torch.randint(0, model.spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        got = hebrus.feed_many(together, chunks)
        for g, s, r, c in zip(got, alone, reference, chunks):
            want, truth = s.feed(c), r.feed(c)
            assert isinstance(g, torch.Tensor)
            assert _rel(g, truth) <= 3 * _rel(want, truth) + 2e-2, (_rel(g, truth), _rel(want, truth))


@cuda
def test_batch_graphs_match_eager_batches(tmp_path):
    """`hebrus.Batch` from CUDA graphs against the same plan launched op by op ("planned"): the
    same kernels, so the same logits within rounding, whichever sessions step together (a
    16-bit random model amplifies any other difference of rounding far past a fixed bound: the
    kernels themselves are tested against their twins); a NaN in one session inside a replay
    aborts it alone."""
    from hebrus.errors import NonFiniteError
    model = _graph_models(tmp_path)["qwen3_5-bfloat16"]
    vocab = model.spec.vocab_size
    groups = []
    for decode in ("graph", "planned"):
        sessions = [model.session(decode=decode) for _ in range(4)]
        for i, s in enumerate(sessions):
            s.feed(_ids(5 + 3 * i, vocab, i))
        groups.append(sessions)
    together, planned = hebrus.Batch(groups[0]), hebrus.Batch(groups[1], decode="planned")
    assert together.decode == "graph"
    for step in range(12):
        ids = _ids(4, vocab, 100 + step)
        for a, b in zip(together.feed(ids), planned.feed(ids)):
            assert _rel(a.float(), b.float()) <= 1e-3, step
    steps = together._steps
    assert steps.captures >= 1 and steps.replays >= 6, (steps.captures, steps.replays, steps.refused)
    captured, replays = steps.captures, steps.replays       # sessions leave and join: the same graphs
    for step, members in enumerate([(0, 1, 2), (1, 2, 3), (0, 1, 2, 3), (3, 0, 2)]):
        ids = _ids(len(members), vocab, 200 + step)
        got = hebrus.Batch([groups[0][m] for m in members]).feed(ids)
        want = hebrus.Batch([groups[1][m] for m in members], decode="planned").feed(ids)
        assert all(_rel(a.float(), b.float()) <= 1e-3 for a, b in zip(got, want)), step
    assert steps.captures == captured and steps.replays == replays + 4
    poisoned = with_nan_row(model, 5)
    sessions = [poisoned.session() for _ in range(3)]
    for s in sessions:
        s.feed([1, 2, 3])
    group = hebrus.Batch(sessions)
    for t in (6, 7, 8):
        group.feed([t, t, t])
    before = sessions[1].digest()
    got = group.feed([1, 5, 2])
    assert isinstance(got[1], NonFiniteError) and sessions[1].digest() == before
    assert group._steps.replays >= 1
    assert all(torch.isfinite(r.float()).all() for r in group.feed([3, 4, 6]))


@cuda
def test_a_paced_pass_beside_graph_replays_is_the_pass_in_one_call(tmp_path):
    """A pass of prompt chunks run a stage at a time (`engine.paced`, as `hebrus serve --passes
    paced` runs it), other sessions' steps replayed from CUDA graphs between its stages, against
    forks fed the same chunks in one call: the same kernels in the same order, so the same bits
    and the same states."""
    from hebrus.engine.paced import Paced
    model = _graph_models(tmp_path)["qwen3_5-bfloat16"]
    vocab = model.spec.vocab_size
    feeding = [model.session(decode="eager") for _ in range(3)]
    stepping = [model.session() for _ in range(4)]
    for i, s in enumerate(feeding + stepping):
        s.feed(_ids(3 + 5 * i, vocab, i))
    twins, steppers = [s.fork() for s in feeding], [s.fork() for s in stepping]
    chunks = [_ids(n, vocab, 50 + n) for n in (40, 1, 130)]
    group = hebrus.Batch(stepping)
    paced = Paced(lambda: hebrus.feed_many(feeding, chunks))
    turns, stepped = 0, []
    while not paced.advance(1):
        turns += 1
        stepped.append([r.clone() for r in group.feed(_ids(4, vocab, 300 + turns))])
    assert turns >= len(model.stages) - 1 and group._steps.replays >= 1
    for i, (got, want) in enumerate(zip(paced.outcome(), hebrus.feed_many(twins, chunks))):
        assert torch.equal(got, want), (i, _rel(got.float(), want.float()))
        assert feeding[i].digest() == twins[i].digest(), i
    alone = hebrus.Batch(steppers)              # the same steps with no pass between them
    for turn, got in enumerate(stepped, 1):
        assert all(torch.equal(a, b) for a, b in zip(got, alone.feed(_ids(4, vocab, 300 + turn)))), turn
    assert [s.digest() for s in stepping] == [s.digest() for s in steppers]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_one_row_product_matches_f_linear(dtype):
    """The Triton product of a batch-1 step's row (`ops.cuda.gemv`) against F.linear in float32,
    at the launch shape it picks and the others it may pick, for widths that are and are not
    multiples of a tile, and for rows laid inside a wider storage (weights side by side);
    deterministic; every case it does not take (two rows, float32, a quantized weight) is the
    twin itself."""
    import torch.nn.functional as F
    from hebrus.ops.cuda.gemv import launch, launch_shape, linear, takes
    from hebrus.ops.quant import quantize
    g = torch.Generator(device="cuda").manual_seed(11)
    for N, K in ((37, 300), (2048, 2048), (8224, 2048), (513, 1000), (2048, 6144)):
        wide = torch.randn(N, K + 8, generator=g, device="cuda").to(dtype)
        x = torch.randn(1, K, generator=g, device="cuda").to(dtype)
        for w in (wide[:, :K].contiguous(), wide[:, :K]):
            assert takes(x, w)
            want = F.linear(x.float(), w.float())
            for shape in {launch_shape(N, K), (4, 128, 8), (16, 128, 8), (4, 512, 2), (4, 256, 2)}:
                got = launch(x, w, shape)
                assert got.dtype == dtype and got.shape == (1, N)
                assert _rel(got.float(), want) <= (1e-2 if dtype == torch.bfloat16 else 2e-3), (N, K, shape)
            assert torch.equal(linear(x, w), linear(x, w))
    w = torch.randn(64, 32, generator=g, device="cuda").to(dtype)
    two, wide32 = torch.randn(2, 32, generator=g, device="cuda").to(dtype), w.float()
    assert not takes(two, w) and torch.equal(linear(two, w), F.linear(two, w))
    one32 = torch.randn(1, 32, generator=g, device="cuda")
    assert not takes(one32, wide32) and torch.equal(linear(one32, wide32), F.linear(one32, wide32))
    q = quantize(w.float(), "int8")
    assert not takes(one32.to(dtype), q)


@cuda
def test_a_planned_step_takes_the_fused_ops(tmp_path, monkeypatch):
    """A 16-bit Qwen3.5's planned decode step takes the fused ops, not their fallbacks (which give
    the same results, so the graph tests alone would not tell): SwiGLU's middle in the product,
    k and v written by the rotary kernel, the output gate applied as the lanes' runs are weighed."""
    from foreign import build
    from hebrus.ops.cuda import attention_lanes, gemv, rotary
    taken = dict.fromkeys(("silu_gated", "rotary into", "lanes gate"), 0)

    def counting(name, op, took):
        def counted(*args, **kwargs):
            out = op(*args, **kwargs)
            taken[name] += bool(took(args, kwargs, out))
            return out
        counted.__dict__.update(op.__dict__)          # what the layer reads off the op (reads_to_position)
        return counted
    # the kinds import their ops when the model is built: counted from then on
    monkeypatch.setattr(gemv, "silu_gated", counting("silu_gated", gemv.silu_gated, lambda a, k, out: out is not None))
    monkeypatch.setattr(rotary, "normed_rotated_pair", counting(
        "rotary into", rotary.normed_rotated_pair, lambda a, k, out: out is not None and len(a) > 7 and a[7] is not None))
    monkeypatch.setattr(attention_lanes, "attention_lanes_cuda", counting(
        "lanes gate", attention_lanes.attention_lanes_cuda, lambda a, k, out: len(a) > 5 and a[5] is not None))
    folder, _ = build("qwen3_5", tmp_path / "qwen3_5")
    model = hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast")
    session = model.session(decode="planned")
    session.feed([1, 2, 3])
    before = dict(taken)
    session.feed([4])
    assert all(taken[name] > before[name] for name in taken), (before, taken)


@cuda
def test_a_step_launched_as_a_chain_gives_the_same_bits(tmp_path, monkeypatch):
    """With kernels launched as a chain (HEBRUS_PDL=1: programmatic dependent launch,
    `ops.cuda.chain`; the fused ops compiled to take part where this torch can), a 16-bit
    Qwen3.5's prompt and graph decode give the logits and the state of plain launches (the
    switch off, whatever the process was started with), bit for bit: the chain changes when a
    kernel starts, not what it computes; and its launches were chained."""
    from foreign import build
    from hebrus.ops.cuda import chain, fuse
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or more")
    folder, _ = build("qwen3_5", tmp_path / "qwen3_5")
    asked = []
    real = chain.chained

    def counted(device):
        asked.append(real(device))
        return asked[-1]

    def run(wanted: bool):
        monkeypatch.setattr(chain, "WANTED", wanted)
        monkeypatch.setattr(fuse, "_fused", {})             # compiled again, as the switch says
        asked.clear()
        model = hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast")
        s = model.session(decode="graph")
        first = s.feed(_ids(40, model.spec.vocab_size, 1)).clone()
        out = [first] + [s.feed([t]).clone() for t in range(12)]
        return out, s.digest(), s._steps.replays, list(asked)
    for module in ("gemv", "rotary", "gdn_lanes", "attention_lanes"):      # imported by name there
        monkeypatch.setattr(f"hebrus.ops.cuda.{module}.chained", counted)
    plain, digest, _, plain_asked = run(False)
    chained, chained_digest, replays, chained_asked = run(True)
    assert replays > 0 and plain_asked and not any(plain_asked) and chained_asked and all(chained_asked)
    assert all(torch.equal(a, b) for a, b in zip(plain, chained)) and digest == chained_digest


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chained_products_read_what_the_one_before_wrote(dtype, monkeypatch):
    """Fifty one-row products, each reading the row the one before it wrote, launched as a chain
    (each program lets the next kernel launch at its start) and captured in a graph, replayed:
    the same bits as launched plain. A product that read its input before the one before it
    had written it would read the last replay's row."""
    from hebrus.ops.cuda import chain, gemv
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or more")
    g = torch.Generator(device="cuda").manual_seed(3)
    D = 2048
    w = (torch.randn(D, D, generator=g, device="cuda") / D ** 0.5).to(dtype)
    first = torch.randn(1, D, generator=g, device="cuda").to(dtype)

    def chain_of(x):
        for _ in range(50):
            x = gemv.launch(x, w) * 1                  # a torch kernel between some, too
            x = gemv.launch(x, w)
        return x

    def captured(wanted):
        monkeypatch.setattr(chain, "WANTED", wanted)
        x = first.clone()
        chain_of(x)                                     # compiled, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain_of(x)
        outs = []
        for i in range(5):
            x.copy_(first if i % 2 == 0 else -first)
            graph.replay()
            outs.append(out.clone())
        return outs
    plain, chained = captured(False), captured(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, chained))
    assert not torch.equal(plain[0], plain[1])


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gated_product_matches_its_twin(dtype):
    """SwiGLU's gate and up products and its middle in one kernel (`gemv.silu_gated`) against its
    twin, the product then `silu_mul`: within two units in the last place of it at the same
    launch (the same sums, its own exp), near the float32 result at every launch it may pick;
    weights laid inside a wider storage; what it does not take (two rows, an odd number of rows)
    is None. Then a batch-1 MLP takes the op where gate and up lie side by side, and is near the
    MLP through the twin."""
    import torch.nn.functional as F
    from hebrus.layers.mlp import swiglu
    from hebrus.ops.cuda.gemv import _gemv_kernel, _silu_gated_kernel, gated_launch_shape, silu_gated
    from hebrus.ops.moe import silu_mul
    from hebrus.ops.quant import Products
    g = torch.Generator(device="cuda").manual_seed(5)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for N, K in ((37, 300), (6144, 2048), (513, 1000)):
        w = torch.randn(2 * N, K + 8, generator=g, device="cuda").to(dtype)[:, :K]
        x = torch.randn(1, K, generator=g, device="cuda").to(dtype)
        want = silu_mul(*F.linear(x.float(), w.float()).chunk(2, -1))
        for block_n, block_k, warps in {gated_launch_shape(2 * N, K), (1, 2048, 8), (4, 128, 8), (2, 512, 2)}:
            got, both = torch.empty(1, N, device="cuda", dtype=dtype), torch.empty(1, 2 * N, device="cuda", dtype=dtype)
            _silu_gated_kernel[(-(-N // block_n),)](x, w, got, N, K, w.stride(0), BLOCK_N=block_n,
                                                    BLOCK_K=block_k, CHAINED=False, num_warps=warps)
            _gemv_kernel[(-(-2 * N // block_n),)](x, w, both, 2 * N, K, w.stride(0), BLOCK_N=block_n,
                                                  BLOCK_K=block_k, CHAINED=False, num_warps=warps)
            twin = silu_mul(*both.float().chunk(2, -1))        # the two products, rounded as written
            assert ((got.float() - twin).abs() <= 2 * ulp * twin.abs().clamp(min=1.0)).all(), (N, K, block_n, block_k)
            assert _rel(got.float(), want) <= (1e-2 if dtype == torch.bfloat16 else 2e-3), (N, K, block_n, block_k)
        assert torch.equal(silu_gated(x, w), silu_gated(x, w))
    assert silu_gated(torch.randn(2, K, device="cuda").to(dtype), w) is None
    assert silu_gated(x, w[1:]) is None
    D, inner = 256, 512
    laid = torch.randn(2 * inner, D, generator=g, device="cuda").to(dtype)
    down = torch.randn(D, inner, generator=g, device="cuda").to(dtype)
    gate_up = Products(laid[:inner], laid[inner:], together=True)
    h = torch.randn(1, D, generator=g, device="cuda").to(dtype)
    assert gate_up.together is not None
    calls = []

    def counted(x, w):
        got = silu_gated(x, w)
        calls.append((tuple(w.shape), got is not None))
        return got
    got = swiglu(h, gate_up, down, gated=counted)
    assert calls == [((2 * inner, D), True)]
    assert _rel(got.float(), swiglu(h, gate_up, down).float()) <= (2e-2 if dtype == torch.bfloat16 else 4e-3)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hk, d, width", [(8, 2, 256, 64), (6, 2, 24, 24), (4, 4, 64, 32), (3, 1, 40, 10)])
@pytest.mark.parametrize("T", [1, 5])
def test_the_rotary_kernel_matches_its_twin(dtype, hq, hk, d, width, T):
    """q's and k's norms and rotations in one kernel (`ops.cuda.rotary`) against
    `ops.rope.normed_rotated_pair` in float64 on the same values, q and k slices of one product's
    columns as the layer passes them, partial and whole rotary widths, a head that is not a power
    of two; deterministic; float32 and odd widths left to the twin (None). With the step's k and v
    rows written into two caches too, against the twin's writes."""
    from hebrus.ops.cuda.rotary import normed_rotated_pair as kernel
    from hebrus.ops.rope import normed_rotated_pair, rope_tables
    g = torch.Generator(device="cuda").manual_seed(hq * d + T)
    projected = torch.randn(T, (hq + 2 * hk) * d + 7, generator=g, device="cuda").to(dtype)
    q, k = projected[:, :hq * d].view(T, hq, d), projected[:, hq * d:(hq + hk) * d].view(T, hk, d)
    wq, wk = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).to(dtype), torch.rand(d, generator=g, device="cuda").to(dtype)
    cos, sin = rope_tables(width, 10000.0, 64, dtype, "cuda")
    at = torch.tensor([0, 3, 17, 40, 63][:T], device="cuda")
    cos, sin = cos[at], sin[at]
    got = kernel(q, k, wq, wk, cos, sin, 1e-6)
    assert all(torch.equal(x, y) for x, y in zip(got, kernel(q, k, wq, wk, cos, sin, 1e-6)))
    want = normed_rotated_pair(*(t.double() for t in (q, k, wq, wk, cos, sin)), 1e-6)
    for x, y in zip(got, want):
        assert x.dtype == dtype and x.shape == y.shape and _rel(x, y) <= 1e-2
    assert kernel(q.float(), k.float(), wq, wk, cos.float(), sin.float(), 1e-6) is None
    assert kernel(q, k, wq, wk, cos[:, :width - 1], sin[:, :width - 1], 1e-6) is None
    # with `into`: k's rows and v's written where the step's tables say, by the kernel as by the
    # twin (k's rows the very bits it returns, v's copied), every other row untouched
    v = projected[:, (hq + hk) * d:(hq + 2 * hk) * d].view(T, hk, d)
    caches = torch.randn(2, 6, 4, hk, d, generator=g, device="cuda").to(dtype)
    blocks, offsets = (torch.tensor(x[:T], device="cuda") for x in ([3, 0, 5, 1, 3], [1, 3, 0, 2, 2]))
    k_cache, v_cache = caches.clone()
    into = kernel(q, k, wq, wk, cos, sin, 1e-6, (v, k_cache, v_cache, blocks, offsets))
    assert all(torch.equal(x, y) for x, y in zip(into, got))
    k_twin, v_twin = caches.clone()
    k_twin[blocks, offsets], v_twin[blocks, offsets] = got[1], v
    assert torch.equal(k_cache, k_twin) and torch.equal(v_cache, v_twin)
    twin = caches.double()
    normed_rotated_pair(*(t.double() for t in (q, k, wq, wk, cos, sin)), 1e-6, (v.double(), *twin, blocks, offsets))
    assert _rel(k_cache.double(), twin[0]) <= 1e-2 and torch.equal(v_cache.double(), twin[1])
    assert kernel(q, k, wq, wk, cos, sin, 1e-6, (v, k_cache.float(), v_cache.float(), blocks, offsets)) is None


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("format", ["int8", "int4", "int4-zp", "fp8"])
def test_quantized_kernels_match_the_rebuilt_twin(format, dtype):
    """The Triton products against rebuilding W and F.linear, at widths that are and are not
    multiples of a group or block (an odd number of inputs too), groups and blocks of 32 and
    2,048 beside the default: the vector kernels (a row or two; a float32 x's few rows) and the
    matrix kernel (more rows of a 16-bit x), there also at tiles of 16 and 32 rows and outputs."""
    from hebrus.ops.cuda.quant import FEW_ROWS, VECTOR_ROWS, launch, takes
    from hebrus.ops.quant import quantize, rebuilt_linear
    from hebrus.weights.quant import Quantization
    q = Quantization.parse(format)
    g = torch.Generator(device="cuda").manual_seed(7)
    cases = ((4096, 4096, 1, None), (1000, 300, 2, None), (1000, 301, 1, 32), (1000, 300, 3, None),
             (256, 1024, FEW_ROWS, None), (300, 4100, 2, 2048), (500, 303, 1, None))     # int4 as words, a part word
    half = ((130, 384, 64, None), (6144, 2048, 33, None), (100, 301, 40, 32), (300, 4100, 64, 2048))
    for N, K, M, group in cases + (half if dtype != torch.float32 else ()):
        w = quantize(torch.randn(N, K, generator=g, device="cuda"), q.format, group=group, zero_point=q.zero_point)
        x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        assert takes(x, w)
        got, want = launch(x, w), rebuilt_linear(x.float(), w).to(dtype)
        assert got.dtype == dtype and got.shape == want.shape
        assert _rel(got.float(), want.float()) <= (1e-5 if dtype == torch.float32 else 1e-2), (N, K, M)
        assert torch.equal(launch(x, w), got)                         # deterministic
        if M > VECTOR_ROWS and dtype != torch.float32:                # the matrix kernel's narrow tiles too
            side = 128 if w.format == "int8" else w.group             # an int4 group, an fp8 block: whole in a tile
            for shape in ((16, min(32, side), min(128, side), 4), (32, 16, min(64, side), 4)):
                assert _rel(launch(x, w, shape).float(), want.float()) <= 1e-2, (N, K, M, shape)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("format", ["int8", "int4", "int4-zp", "fp8"])
def test_quantized_silu_gated_matches_its_twin(format, dtype):
    """SwiGLU's gate and up by a quantized [G; U] and its middle in one vector kernel against the
    rebuilt product, then `silu_mul`, for a row or two: halves that do and do not fill a block of
    fp8 scales (up's rows then start inside one), an odd number of inputs, groups of 32 and 2,048
    beside the default, at the default launch and at others; None where the kernel does not take
    it (more rows, float32, an odd number of rows, a dense weight)."""
    from hebrus.ops.cuda.quant import silu_gated, vector_shape
    from hebrus.ops.moe import silu_mul
    from hebrus.ops.quant import quantize, rebuilt_linear
    from hebrus.weights.quant import Quantization
    q = Quantization.parse(format)
    g = torch.Generator(device="cuda").manual_seed(11)
    for H, K, group in ((6144, 2048, None), (70, 256, None), (1000, 301, 32), (256, 4100, 2048)):
        w = quantize(torch.randn(2 * H, K, generator=g, device="cuda"), q.format, group=group, zero_point=q.zero_point)
        block_n, block_k, warps = vector_shape(w)
        for M in (1, 2):
            x = torch.randn(M, K, generator=g, device="cuda").to(dtype)
            # each product rounded to x's dtype, as the kernel rounds it before the middle
            gate, up = rebuilt_linear(x.float(), w).to(dtype).chunk(2, dim=-1)
            want = silu_mul(gate.float(), up.float())
            for shape in (None, (1, block_k, warps), (4, block_k, 8)):
                got = silu_gated(x, w, shape)
                assert got.dtype == dtype and got.shape == (M, H)
                assert _rel(got.float(), want) <= 1e-2, (H, K, M, shape)
                assert torch.equal(silu_gated(x, w, shape), got)          # deterministic
    assert silu_gated(torch.randn(3, K, device="cuda").to(dtype), w) is None
    assert silu_gated(x.float(), w) is None
    odd = quantize(torch.randn(2 * H + 1, K, generator=g, device="cuda"), q.format, group=group, zero_point=q.zero_point)
    assert silu_gated(x, odd) is None
    assert silu_gated(x, rebuilt_linear(torch.eye(K, device="cuda").to(dtype), w).T.contiguous()) is None


@cuda
@pytest.mark.parametrize("format", ["int8", "int4", "fp8"])
def test_a_quantized_step_with_swiglu_in_one_kernel_stays_near_float32(format, tmp_path, monkeypatch):
    """A tiny Qwen3.5 quantized (inner width 128: fp8's gate and up lie together too) decodes as
    near the same weights in float32 with SwiGLU's quantized gate, up and middle in one kernel as
    with the products apart, then `silu_mul`: over the steps, the median distance of the one
    kernel's logits from float32's at most twice the products' (+1e-3). Both round to 16 bits,
    differently; a wrong kernel moves every step far (a gate's scales read for up: 5-27%)."""
    from foreign import build
    from hebrus.ops.cuda import quant
    folder, _ = build("qwen3_5", tmp_path / "qwen3_5", intermediate_size=128)
    model = hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast", quantize=format)
    prompt, tokens = list(range(3, 40)), list(range(12))

    def steps(m):
        s = m.session(decode="eager")
        s.feed(prompt)
        return [s.feed([t]).float() for t in tokens]
    want = steps(model.with_dtype(torch.float32))
    taken, fused = [], quant.silu_gated
    monkeypatch.setattr(quant, "silu_gated", lambda *a: taken.append(fused(*a)) or taken[-1])
    one = steps(model)
    assert any(out is not None for out in taken)
    monkeypatch.setattr(quant, "silu_gated", lambda *a: None)
    apart = steps(model)
    far = {name: sorted(_rel(a, w) for a, w in zip(got, want))[len(want) // 2]
           for name, got in (("one kernel", one), ("apart", apart))}
    assert far["one kernel"] <= 2 * far["apart"] + 1e-3, far


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("format", ["int8", "int4", "int4-zp", "fp8"])
def test_quantized_experts_match_the_gathered_twin(format, dtype):
    """A decode step's few (token, choice) rows each through its own quantized expert where the
    codes lie (`quant.experts`: the gate, up and middle in one kernel, then down) against
    gathering the chosen experts rebuilt (`ops.moe.experts_gathered`), with and without
    SwiGLU's clipping; experts of an odd inner width (fp8's up rows then start inside a block
    of scales)."""
    from hebrus.ops.cuda import quant
    from hebrus.ops.moe import experts_gathered
    from hebrus.ops.quant import quantize
    from hebrus.weights.quant import Quantization
    q = Quantization.parse(format)
    g = torch.Generator(device="cuda").manual_seed(5)
    calls = []
    vector = quant._vector
    for E, D, inner in ((8, 2048, 768), (5, 256, 70)):
        gate_up = quantize(torch.randn(E, 2 * inner, D, generator=g, device="cuda"), q.format, zero_point=q.zero_point)
        down = quantize(torch.randn(E, D, inner, generator=g, device="cuda"), q.format, zero_point=q.zero_point)
        for T, k in ((1, 2), (2, 4), (8, 2)):
            h = torch.randn(T, D, generator=g, device="cuda").to(dtype)
            experts = torch.randint(0, E, (T, k), generator=g, device="cuda")
            weights = torch.rand(T, k, generator=g, device="cuda")
            for limit in (None, 2.0):
                quant._vector = lambda *a, **kw: calls.append(1) or vector(*a, **kw)
                try:
                    got = quant.experts(h, weights, experts, gate_up, down, limit)
                finally:
                    quant._vector = vector
                want = experts_gathered(h.float(), weights, experts, gate_up, down, limit)
                assert got.dtype == dtype and got.shape == (T, D)
                assert _rel(got.float(), want) <= (1e-5 if dtype == torch.float32 else 2e-2), (E, D, inner, T, k, limit)
                assert torch.equal(quant.experts(h, weights, experts, gate_up, down, limit), got)
    assert len(calls) == 2 * 2 * 3 * 2                # every case through the kernels, none through the twin


@cuda
@pytest.mark.parametrize("format", ["int4", "fp8"])
def test_a_quantized_model_verifies_and_decodes_from_graphs_on_cuda(format, tmp_path, monkeypatch):
    """The tiny preset quantized verifies; a saved tiny Qwen3.5 quantized decodes from graphs
    near its eager steps. Not the tiny preset for the second: its sparse attention's indexer
    scores tie exactly and its experts' routes lie within 4e-4 of a tie, so its graph route (the
    lanes' conv in float32) flips where eager does not, and lies far from float32 at those steps
    (fp8 on an H100: graph 0.108 median against eager's 0.027; without the GDN lanes' op the
    graph route is eager's bit for bit: `benchmarks/diag/graph_flips.py --quantize fp8 --inputs
    test --without gdn.lanes`, results/cuda-h100/graph-flips-fp8-*.txt). Its decode steps take
    SwiGLU's quantized gate and up with its middle in one kernel (`quant.silu_gated`) where the
    two lie together."""
    from foreign import build
    from hebrus import verify
    from hebrus.ops.cuda import quant
    taken = []
    fused = quant.silu_gated
    monkeypatch.setattr(quant, "silu_gated", lambda *a: taken.append(fused(*a)) or taken[-1])
    model = hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast", quantize=format)
    failed = [r for r in verify.run(model) if not r.passed]
    assert not failed, [(r.name, r.detail) for r in failed]
    folder, _ = build("qwen3_5", tmp_path / "qwen3_5")
    qwen = hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast", quantize=format)
    graph = _graph_steps_near_eager(qwen, list(range(3, 40)), list(range(12)))
    assert graph._steps.replays > 0
    # fp8's gate and up lie apart here (56 rows fill no block of 128 scales): no one kernel then
    assert any(out is not None for out in taken) == (format != "fp8")


@cuda
@pytest.mark.parametrize("kv_cache", ["int8", "fp8"])
def test_a_quantized_cache_decodes_from_graphs_on_cuda(kv_cache, tmp_path):
    model = hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast", kv_cache=kv_cache)
    graph = _graph_steps_near_eager(model, list(range(3, 40)), list(range(12)))
    assert graph._steps.replays > 0


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_transaction_on_cuda_matches_the_cpu_and_its_twin(dtype):
    """A prefix transaction in fast mode on the GPU: its per-token delta-rule states, the kept
    prefix's state and logits against the two-pass form there, both forms following exact
    mode's discrete choices (experts, attended rows: the two forms' kernels round differently,
    and a choice at a near-tie may go either way; each fast choice that differs from exact's
    must be at a near-tie, `Bound.margin`), and the greedy speculative output against plain
    greedy decoding; exact mode on the GPU keeps its bit-identity."""
    from hebrus.bound import BOUNDS, record
    from hebrus.layers.replay import Replayer
    prompt = list(b"To be, or not to be, that is the question. To be, or not")
    chunk = list(b" to be, that")
    for mode in ("exact", "fast"):
        model = forms = hebrus.load("shakespeare", device="cuda", dtype=dtype, mode=mode)
        if mode == "fast":
            _, _, recorder = record(model, prompt + chunk)
            replayer = Replayer(recorder.log, inner=model.kernels.choose)
            forms = model.with_mode("fast", replayer)
        for k in (0, 3, len(chunk)):
            one, two = forms.session(decode="eager"), forms.session(decode="eager")
            one.feed(prompt)
            two.feed(prompt)
            k1, logits1 = one.feed_prefix(chunk, lambda logits, k=k: k)
            k2, logits2 = two.feed_prefix_twice(chunk, lambda logits, k=k: k)
            assert k1 == k2 == k and one.frontier == two.frontier
            if mode == "exact":
                assert torch.equal(logits1, logits2) and one.digest() == two.digest()
            else:
                assert _rel(logits1, logits2) <= (2e-2 if dtype == "bfloat16" else 1e-4)
                for name in ("layers.0.gdn.recurrent", "residual", "logits"):
                    assert _rel(one.image.read(name), two.image.read(name)) <= (2e-2 if dtype == "bfloat16" else 1e-4)
        if mode == "fast":
            scales, margin = recorder.scales(), BOUNDS[model.dtype].margin
            far = [(f.site, f.position, f.gap / scales[f.site]) for f in replayer.flips if f.gap / scales[f.site] > margin]
            assert not far, far
        plain = model.session()
        want = list(plain.generate(prompt, max_new_tokens=24))
        got = list(model.session().generate(prompt, max_new_tokens=24, speculate="lookup"))
        if mode == "exact":
            assert got == want
        else:                                   # fast mode: equal up to a near-tie flipped by rounding
            assert got[:8] == want[:8]


@cuda
def test_the_server_decodes_from_graphs_on_cuda_and_a_failure_stays_alone():
    """`hebrus serve` on CUDA in fast mode: requests decoding together step from a `Batch`'s
    graphs; each greedy answer is what its session gives alone, and one request failed through
    the test-only hook ends in a 500 while the others complete."""
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor
    from test_serve import Server, _greedy
    model = hebrus.load("tiny", device="cuda", mode="fast")
    doomed = "Lay on, Macduff"

    def fault(request):
        return "head" if bytes(request.prompt) == doomed.encode() and len(request.produced) == 5 else None
    server = Server(model, fault=fault, max_sessions=8)
    try:
        def ask(prompt):
            try:
                return server.client().completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                                          temperature=0).choices[0].text
            except openai.InternalServerError as exc:
                return exc
        prompts = [f"Speak {i}, speak" for i in range(7)] + [doomed]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, prompts))
        assert isinstance(results[7], openai.InternalServerError) and results[7].code == "aborted_nonfinite"
        for prompt, text in zip(prompts[:7], results[:7]):
            assert text == _greedy(model, prompt.encode(), 24, temperature=0.0), prompt
        assert server.scheduler.widest > 1 and server.scheduler.timed["replayed"] > 0, server.scheduler.timed
    finally:
        server.close()


@cuda
def test_a_session_on_cuda_saves_restores_journals_and_speaks_text(tmp_path):
    """The durable session and the text layer on the GPU: a snapshot restores onto the device
    with the same digest and the same next step; a journal recovers it; the text-level defaults
    (device and dtype auto) pick CUDA and bfloat16 and generate."""
    model = hebrus.load("tiny", device="cuda", dtype=torch.bfloat16, mode="fast")
    s = model.session(journal=tmp_path / "j")
    s.feed(list(b"So foul and fair"))
    s.save(tmp_path / "s")
    back = model.restore(tmp_path / "s")
    assert back.digest() == s.digest() and back.image.read("residual").device.type == "cuda"
    assert torch.equal(back.feed([1, 2]), s.feed([1, 2])) and back.digest() == s.digest()
    s.journal.close()
    assert model.recover(tmp_path / "j").digest() == s.digest()
    auto = hebrus.text.entry.load("tiny")
    assert auto.device.type == "cuda" and auto.dtype == torch.bfloat16
    assert isinstance(hebrus.generate(auto, "Hail", max_new_tokens=8, seed=1), str)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hk, dk, hv, dv, Kc", [(16, 128, 16, 128, 4), (2, 64, 4, 96, 4), (1, 16, 2, 40, 2)])
@pytest.mark.parametrize("laid", [False, True])
@pytest.mark.parametrize("one_bank", [False, True])
def test_the_gdn_lanes_kernels_match_their_twin(dtype, hk, dk, hv, dv, Kc, laid, one_bank):
    """The conv and the delta rule of one token per lane, both states read from and written to
    the pool's banks where they lie, against `ops.gdn.gdn_lanes` in float64 on the same values:
    outputs, both banks after (either parity), and the checks (NaN exactly for the lane whose
    written conv window holds a NaN, and for those whose recurrent state does: one read so, one
    with a NaN gate input). `one_bank`: each lane reads and writes the bank of its parity (the
    in-place measurement's way), where programs sharing a key head read the windows one of them
    writes."""
    from hebrus.ops.cuda.gdn_lanes import gdn_lanes_cuda
    from hebrus.ops.gdn import gdn_lanes
    from hebrus.state.context import InPlace
    g = torch.Generator(device="cuda").manual_seed(hk + dv)
    N, slots, C = 6, 9, 2 * hk * dk + hv * dv
    if laid:                    # slices of one product's columns, as a fast model's projections give them
        projected, _, b, a = torch.randn(N, C + 3 * hv, generator=g, device="cuda").to(dtype).split([C, hv, hv, hv], 1)
    else:
        projected = torch.randn(N, C, generator=g, device="cuda").to(dtype)
        b, a = (torch.randn(N, hv, generator=g, device="cuda").to(dtype) for _ in range(2))
    conv_w = (torch.randn(C, Kc, generator=g, device="cuda") * 0.5).to(dtype)
    neg_a, dt_bias = -4 * torch.rand(hv, generator=g, device="cuda"), 0.1 * torch.randn(hv, generator=g, device="cuda")
    conv_bank = torch.randn(2, slots, C, Kc - 1, generator=g, device="cuda").to(dtype)
    rec_bank = torch.randn(2, slots, hv, dk, dv, generator=g, device="cuda") * 0.1
    source = torch.tensor([0, 1, 1, 0, 1, 1], device="cuda")
    chosen = torch.tensor([3, 0, 8, 1, 5, 6], device="cuda")
    projected[3, 3] = float("nan")                              # lane 3's new q input: in its window after, not in its state
    rec_bank[1, 5, hv - 1, 7, 11] = float("nan")                 # lane 4's state
    a[0, hv - 1] = float("nan")                                  # lane 0's gate: its state not finite
    got_c, got_r = conv_bank.clone(), rec_bank.clone()
    want_c, want_r = conv_bank.double(), rec_bank.double()
    heads, target = (hk, dk, hv, dv), source if one_bank else 1 - source
    want = gdn_lanes(projected.double(), b.double(), a.double(), conv_w.double(), neg_a.double(), dt_bias.double(),
                     heads, InPlace(want_c, source, target, chosen), InPlace(want_r, source, target, chosen))
    got = gdn_lanes_cuda(projected, b, a, conv_w, neg_a, dt_bias, heads,
                         InPlace(got_c, source, target, chosen), InPlace(got_r, source, target, chosen))
    for x, y in [(got[0], want[0]), (got_c, want_c), (got_r, want_r)]:
        seen = torch.isfinite(y)
        assert torch.equal(seen, torch.isfinite(x)) and _rel(x[seen], y[seen]) <= 1e-4
    for x, y, lanes in [(got[1], want[1], {3}), (got[2], want[2], {0, 4})]:
        bad = torch.isnan(y).any(-1)
        assert torch.equal(torch.isnan(x).any(-1), bad) and bad.tolist() == [i in lanes for i in range(N)]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv, dh, R", [(16, 2, 256, 16), (6, 2, 24, 8), (8, 8, 64, 16)])
@pytest.mark.parametrize("runs", [None, 1, 3])
@pytest.mark.parametrize("tile", [16, 64])
def test_the_attention_lanes_kernel_matches_its_twin(dtype, hq, hkv, dh, R, runs, tile, monkeypatch):
    """One query per lane over its rows read through its block table where they lie (blocks
    scattered, one shared by two lanes, lanes at row 0, mid-block and the table's last row), read
    a block or several at a time and dealt to as many runs as the device asks for, one, or three,
    against `ops.qsa.dense_attention_lanes` in float64 on the same values; then with the output
    gate."""
    from hebrus.ops.cuda import attention_lanes
    from hebrus.ops.cuda.attention_lanes import attention_lanes_cuda
    from hebrus.ops.qsa import dense_attention_lanes
    monkeypatch.setattr(attention_lanes, "TILE", tile)
    g = torch.Generator(device="cuda").manual_seed(hq + dh)
    N, W = 7, 5
    k_blocks, v_blocks = (torch.randn(N * W + 4, R, hkv, dh, generator=g, device="cuda").to(dtype) for _ in range(2))
    tables = torch.randperm(N * W + 4, generator=g, device="cuda")[:N * W].view(N, W)
    tables[5, 0] = tables[2, 0]
    q = torch.randn(N, hq, dh, generator=g, device="cuda").to(dtype)
    positions = torch.tensor([0, 1, R - 1, R, W * R - 1, 2 * R + 3, 17], device="cuda")
    got = attention_lanes_cuda(q, k_blocks, v_blocks, tables, positions, runs=runs)
    want = dense_attention_lanes(q.double(), k_blocks.double(), v_blocks.double(), tables, positions)
    assert got.dtype == dtype and _rel(got.double(), want) <= 1e-2
    # with the output gate (a slice of a wider row, as the layer passes it): the gate on the
    # result rounded to its dtype, as the twin's two ops give it
    gate = torch.randn(N, hq * dh + 5, generator=g, device="cuda").to(dtype)[:, :hq * dh].view(N, hq, dh)
    gated = attention_lanes_cuda(q, k_blocks, v_blocks, tables, positions, gate, runs=runs)
    twin = got.float() * torch.sigmoid(gate.float())
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert ((gated.float() - twin).abs() <= 2 * ulp * twin.abs().clamp(min=1.0)).all()
    want = dense_attention_lanes(q.double(), k_blocks.double(), v_blocks.double(), tables, positions, gate.double())
    assert _rel(gated.double(), want) <= 1e-2


@cuda
def test_the_attention_lanes_kernels_compile_once_for_any_context():
    """The runs a table is dealt to and the table's width grow with the context; the kernels
    take both as plain arguments, so lanes at contexts no call met before run the kernels made
    for the first (a server's warm-up meets short contexts only: each new count compiled both
    again, a 1.5 s step)."""
    from hebrus.ops.cuda import attention_lanes
    from hebrus.ops.cuda.attention_lanes import attention_lanes_cuda

    def made() -> int:
        return sum(len(caches[0]) for fn in (attention_lanes._runs, attention_lanes._weigh)
                   for caches in fn.device_caches.values())
    g = torch.Generator(device="cuda").manual_seed(4)
    R, hkv, dh, N = 16, 2, 64, 2
    counts = []
    for W in (2, 5, 9, 17, 40, 130, 600):              # up to runs past the weighing's block of 16
        blocks = torch.randn(N * W, R, hkv, dh, generator=g, device="cuda").to(torch.bfloat16)
        tables = torch.arange(N * W, device="cuda").view(N, W)
        q = torch.randn(N, 8, dh, generator=g, device="cuda").to(torch.bfloat16)
        positions = torch.tensor([W * R - 1, (W * R) // 2], device="cuda")
        before = made()
        attention_lanes_cuda(q, blocks, blocks, tables, positions)
        counts.append(made() - before)
    assert counts[0] <= 2 and not any(counts[1:]), counts      # (the first may find them made by another test)


@cuda
def test_graph_steps_publish_each_sessions_constraint():
    """Steps replayed from CUDA graphs advance each session's constraint by its token (the flip
    publishes it with the rest), and a token it does not allow is refused before the step."""
    pytest.importorskip("llguidance")
    from hebrus.text.grammar import Grammar
    model = hebrus.load("tiny", device="cuda", dtype="bfloat16", mode="fast")
    start = Grammar.json({"type": "object"}).start(model.tokenizer, model.spec.vocab_size)
    sessions = [model.session(decode="graph") for _ in range(3)]
    for s in sessions:
        s.feed([1, 2])
    sessions[1].constrain(start)
    batch = hebrus.Batch(sessions, decode="graph")
    for token in b'{"ab": [1, 2]}':
        batch.feed([7, token, 9])
    assert sessions[1].constraint.finished and sessions[0].constraint is None
    with pytest.raises(hebrus.InvalidInput, match="session 1: .*does not allow"):
        batch.feed([7, ord("x"), 9])
    assert sessions[1].frontier == 2 + len(b'{"ab": [1, 2]}')


def _kda_inputs(T, H, dk, dv, seed=0):
    """KDA's inputs on the CPU in float64 (a decay per key channel) and on CUDA (q/k/v bf16)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=gen), dim=-1)
    v = torch.randn(T, H, dv, generator=gen)
    g = -torch.rand(T, H, dk, generator=gen) * 2
    beta = torch.rand(T, H, generator=gen)
    state = torch.randn(H, dk, dv, generator=gen) * 0.1
    rounded = tuple(t.to(torch.bfloat16).double() if i < 3 else t.double() for i, t in enumerate((q, k, v, g, beta)))
    gpu = tuple(t.cuda().to(torch.bfloat16) if i < 3 else t.cuda() for i, t in enumerate((q, k, v, g, beta)))
    return rounded + (state.double(),), gpu + (state.cuda(),)


@cuda
@pytest.mark.parametrize("T", [1, 64, 200])
def test_fla_kda_matches_the_twins(T):
    """fla's KDA kernels against the definition (`ops.kda`): a chunk, one token, several
    sessions' single tokens, and sessions' chunks of any lengths in one call."""
    from hebrus.ops.cuda import kda as cuda_kda
    from hebrus.ops.kda import kda_recurrent
    if not cuda_kda.available():
        pytest.skip("needs fla with its KDA kernels")
    cpu, gpu = _kda_inputs(T, 4, 64, 128)
    before = gpu[-1].clone()
    o, s = cuda_kda.kda_fla(*gpu)
    want_o, want_s = kda_recurrent(*cpu)
    assert torch.equal(gpu[-1], before) and s.dtype == torch.float32
    assert _rel(o, want_o) <= 3e-2 and _rel(s, want_s) <= 3e-2
    if T == 1:
        return
    n = min(T, 6)                                            # n sessions, a token each
    states = torch.randn(n, 4, 64, 128, generator=torch.Generator().manual_seed(1)).cuda() * 0.1
    o, s = cuda_kda.kda_fla(*(t[:n, None] for t in gpu[:5]), states)
    want = [kda_recurrent(*(t[i:i + 1].double().cpu() for t in gpu[:5]), states[i].double().cpu()) for i in range(n)]
    assert _rel(o[:, 0], torch.cat([w[0] for w in want])) <= 3e-2
    assert _rel(s, torch.stack([w[1] for w in want])) <= 3e-2
    bounds = (0, 1, T // 2, T // 2 + 1, T)
    states = torch.randn(4, 4, 64, 128, generator=torch.Generator().manual_seed(2)).cuda() * 0.1
    o, s = cuda_kda.kda_fla_ragged(*gpu[:5], states, torch.tensor(bounds, device="cuda"), bounds)
    for i in range(4):
        a, b = bounds[i], bounds[i + 1]
        want_o, want_s = cuda_kda.kda_fla(*(t[a:b] for t in gpu[:5]), states[i])
        assert _rel(o[a:b], want_o) <= 1e-2 and _rel(s[i], want_s) <= 1e-2, i


@cuda
def test_kimi_linear_prefills_and_decodes_from_graphs_on_cuda(tmp_path):
    """A tiny Kimi-Linear in bfloat16 fast mode on CUDA (fla's KDA kernels, latent attention):
    a prompt fed whole and in pieces within bfloat16's reach of each other, and graph decoding
    its plan's and no farther from float32 than eager decoding (`_graph_steps_near_eager`).
    Its transaction over every stage is verify's, on the CPU (`test_kimi.py`)."""
    from foreign import build
    folder, _ = build("kimi_linear", tmp_path)
    model = hebrus.load(folder, device="cuda", dtype="bfloat16", mode="fast")
    prompt = _ids(40, model.spec.vocab_size, 3)
    whole, pieces = model.session(), model.session()
    want = whole.feed(prompt)
    for a, b in ((0, 7), (7, 8), (8, 40)):
        got = pieces.feed(prompt[a:b])
    assert _rel(got.float(), want.float()) <= 5e-2
    graph = _graph_steps_near_eager(model, _ids(10, model.spec.vocab_size, 1), _ids(12, model.spec.vocab_size, 2))
    assert graph._steps.replays >= 8, graph._steps.replays
