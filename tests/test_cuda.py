"""The CUDA route against the CPU reference: fla's gated delta rule against the readable twins,
and verify on CUDA for the tiny preset and a tiny Qwen3.5. Skipped where there is no CUDA device
or no fla (CI); run on the device machine, results in benchmarks/results/cuda-h200/."""
from __future__ import annotations

import pytest
import torch

import hebrus
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
        assert model.kernels.delta_rule is gdn.gdn_fla
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
