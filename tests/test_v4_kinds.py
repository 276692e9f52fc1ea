"""DeepSeek-V4's parts that hebrus has (the family's model is not in yet), each against
transformers' module on the same weights in float64: the routed experts (the MoE kind with
√softplus scores and SwiGLU clipping, and the hash-routed kind, each token's experts a row of a
frozen table) against `DeepseekV4SparseMoeBlock`, in exact and fast mode, the clip biting; and
the Hebrus model's hyper-connection residual (`ops.hyper`) against `DeepseekV4HyperConnection`
with the decoder layer's mixing, and its head against `DeepseekV4HyperHead`: the same mHC."""
from __future__ import annotations

import types

import pytest
import torch

from hebrus.layers.kernels import kernels
from hebrus.layers.moe import ExpertsSection, MixtureOfExperts

transformers = pytest.importorskip("transformers")

E, K, D, I, V, LIMIT = 6, 2, 16, 12, 50, 0.3


def _block(kind: str):
    """transformers' block for a `kind` layer ("hash_moe" or "moe"), float64, random weights
    (the correction bias and the token table too)."""
    config = transformers.DeepseekV4Config(
        vocab_size=V, hidden_size=D, moe_intermediate_size=I, num_hidden_layers=2, n_routed_experts=E,
        num_experts_per_tok=K, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=LIMIT,
        mlp_layer_types=["hash_moe", "moe"])
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock
    block = DeepseekV4SparseMoeBlock(config, 0 if kind == "hash_moe" else 1).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
        if kind == "hash_moe":
            block.gate.tid2eid.copy_(torch.rand(V, E, generator=gen).argsort(-1)[:, :K])
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=gen, dtype=torch.float64) * 0.1)
    return block


def _ours(block, kind: str, mode: str) -> MixtureOfExperts:
    section = ExpertsSection(E, K, I, I, shared_gated=False, scoring="sqrtsoftplus", scale=1.5, limit=LIMIT)
    p = f"layers.0.{kind}."
    params = {p + "router.weight": block.gate.weight, p + "experts.gate_up": block.experts.gate_up_proj,
              p + "experts.down": block.experts.down_proj}
    params |= {f"{p}shared.{n}.weight": getattr(block.shared_experts, n).weight
               for n in ("gate_proj", "up_proj", "down_proj")}
    if kind == "hash_moe":
        params[p + "router.table"] = block.gate.tid2eid
    else:
        params[p + "router.bias"] = block.gate.e_score_correction_bias
    spec = types.SimpleNamespace(section=lambda of: section)         # all the block reads of a spec
    return MixtureOfExperts(spec, params, p, kernels(mode), "layers.0.ffn")


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("kind", ["hash_moe", "moe"])
def test_v4_experts_match_transformers_in_float64(kind, mode):
    block = _block(kind)
    moe = _ours(block, kind, mode)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(9, D, generator=gen, dtype=torch.float64) * 3          # large enough for the clip to bite
    ids = torch.randint(0, V, (9,), generator=gen)
    with torch.no_grad():
        want = block(h[None], ids[None])[0]
        gate_up = torch.nn.functional.linear(h, block.experts.gate_up_proj[0])
    assert (gate_up.abs() > LIMIT).any()                                      # the clipping changes something
    weights, experts = moe.route_by_table(h, ids) if kind == "hash_moe" else moe.route(h, 0)
    if kind == "hash_moe":
        assert torch.equal(experts, block.gate.tid2eid[ids])
    got = moe(h, weights, experts)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), float((got - want).abs().max())


def _v4_ffns_model(mode: str):
    """The tiny preset with its feed-forward layers DeepSeek-V4's: hash-routed, then routed by
    √softplus scores, SwiGLU clipped (float64, random weights)."""
    import hebrus
    from hebrus.layers.layout import init_parameters
    from hebrus.runtime import Model
    tiny = hebrus.load("tiny")
    e = tiny.spec.section(ExpertsSection)
    v4 = ExpertsSection(e.experts, e.top_k, e.intermediate, e.shared_intermediate, shared_gated=False,
                        scoring="sqrtsoftplus", scale=1.5, limit=0.5)
    spec = tiny.spec.replace(ffns=("hash_moe", "hash_moe", "moe", "moe"),
                             sections=tuple(v4 if type(s) is ExpertsSection else s for s in tiny.spec.sections))
    params = {name: t.double() if t.is_floating_point() else t for name, t in init_parameters(spec, 3).items()}
    return Model._placed(tiny.config, spec, params, tiny.device, torch.float64, mode)


def test_hash_routed_layers_run_through_the_engine():
    """Their routes are recorded with the routed layers' (each token's the table's row), any
    chunking gives the same bits, and fast mode is near exact."""
    exact = _v4_ffns_model("exact")
    ids = list(range(1, 30))
    whole, chunked = exact.session(), exact.session()
    logits = whole.feed(ids)
    for a in range(0, len(ids), 7):
        last = chunked.feed(ids[a:a + 7])
    assert whole.digest() == chunked.digest() and torch.equal(logits, last)
    table = dict(exact.named_parameters())["layers.0.hash_moe.router.table"]
    routes = whole.image.value("routes")
    assert routes.shape[1] == 4 and torch.equal(routes[:len(ids), 0].long(), table[torch.tensor(ids)])
    torch.testing.assert_close(_v4_ffns_model("fast").session().feed(ids), logits, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("streams", [2, 4])
def test_the_hyper_connection_residual_is_v4s_mhc(streams):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4HyperConnection,
                                                                      DeepseekV4HyperHead)
    from hebrus.ops.hyper import hc_head, hc_post, hc_pre
    config = transformers.DeepseekV4Config(hidden_size=D, hc_mult=streams, hc_sinkhorn_iters=7, hc_eps=1e-6,
                                           rms_norm_eps=1e-6)
    hc, head = DeepseekV4HyperConnection(config).double(), DeepseekV4HyperHead(config).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in (hc, head):
            for _, p in module.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * (0.5 if p.dim() < 2 else 0.1))
    X = torch.randn(9, streams, D, generator=gen, dtype=torch.float64)
    y = torch.randn(9, D, generator=gen, dtype=torch.float64)              # a sublayer's output
    from foreign import float64_everywhere                                  # their .float() casts, widened
    with torch.no_grad(), float64_everywhere():
        post, comb, collapsed = hc(X[None])
        want = post[0].unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), X)
        want_head = head(X[None])[0]
    c, our_post, our_comb = hc_pre(X, hc.fn, hc.base, hc.scale, 7, 1e-6, 1e-6)
    assert torch.allclose(c, collapsed[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(hc_post(X, y, our_post, our_comb), want, rtol=1e-12, atol=1e-12)
    got_head = hc_head(X, head.hc_fn, head.hc_base, head.hc_scale, 1e-6, 1e-6)
    assert torch.allclose(got_head, want_head, rtol=1e-12, atol=1e-12)
