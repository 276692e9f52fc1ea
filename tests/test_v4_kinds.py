"""DeepSeek-V4's parts that hebrus has (the family's model is not in yet), each against
transformers' module on the same weights in float64: the attention of each layer type (the
sliding window, HCA, CSA with its indexer: `ops.v4`, token by token from its state, against
`DeepseekV4Attention` with its cache, fed in chunks); the routed experts (the MoE kind with
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
from hebrus.ops.choose import top_k

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


# ---- attention: the sliding window, HCA and CSA against DeepseekV4Attention --------------------

ATT = dict(hidden_size=16, num_attention_heads=4, head_dim=8, partial_rotary_factor=0.5, q_lora_rank=6,
           o_groups=2, o_lora_rank=5, sliding_window=5, index_n_heads=8, index_head_dim=4, index_topk=2,
           rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
           compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 4})
TYPES = ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention")


def _attention(layer_type: str):
    """transformers' attention of a `layer_type` layer and its rotary, float64, random weights
    (the rotary's frequencies recomputed in float64)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding
    # every layer of the type: the model's mask is built from its first layer's cache
    config = transformers.DeepseekV4Config(num_hidden_layers=1, layer_types=[layer_type], vocab_size=V,
                                           mlp_layer_types=["moe"], **ATT)
    config._attn_implementation = "eager"
    layer = DeepseekV4Attention(config, 0).double().eval()
    rotary = DeepseekV4RotaryEmbedding(config).double()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * (0.7 if p.dim() < 2 else p.shape[-1] ** -0.5))
        for module in [rotary] + [m for m in layer.modules() if hasattr(m, "main_inv_freq")]:
            for kind, theta in (("main", 10000.0), ("compress", 160000.0)):
                rope = 4
                module.register_buffer(f"{kind}_inv_freq", theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope),
                                       persistent=False)
    return config, layer, rotary


def _weights(layer) -> dict:
    w = {"q_a": layer.q_a_proj.weight, "q_a_norm": layer.q_a_norm.weight, "q_b": layer.q_b_proj.weight,
         "kv": layer.kv_proj.weight, "kv_norm": layer.kv_norm.weight, "sinks": layer.sinks,
         "o_a": layer.o_a_proj.weight, "o_b": layer.o_b_proj.weight}
    c = layer.compressor
    if c is not None:
        w |= {"c_kv": c.kv_proj.weight, "c_gate": c.gate_proj.weight, "c_bias": c.position_bias, "c_norm": c.kv_norm.weight}
        if hasattr(c, "indexer"):
            i = c.indexer
            w |= {"i_kv": i.kv_proj.weight, "i_gate": i.gate_proj.weight, "i_bias": i.position_bias,
                  "i_norm": i.kv_norm.weight, "i_q_b": i.q_b_proj.weight, "i_weights": i.scorer.weights_proj.weight}
    return {k: v.detach() for k, v in w.items()}


def _shape(layer_type: str):
    from hebrus.ops.v4 import Shape
    rate = ATT["compress_rates"].get(layer_type, 0)
    csa = layer_type == "compressed_sparse_attention"
    return Shape(4, 8, 4, ATT["sliding_window"], 2, 1e-6, rate, csa, 8 if csa else 0, 4 if csa else 0, 2 if csa else 0)


@pytest.mark.parametrize("chunks", [(23,), (7, 1, 6, 9), (1,) * 23])
@pytest.mark.parametrize("layer_type", TYPES)
def test_v4_attention_matches_transformers_in_float64(layer_type, chunks, monkeypatch):
    """Each layer type, fed in chunks that split windows anywhere (transformers with its cache,
    ours token by token from its state): the same outputs within 1e-12, and the windows crossed
    (the prompt closes several entries; the indexer keeps fewer than it sees). The indexer's
    scores are sums of ReLUs, exactly 0 where every head's is: a tie at the cut would be broken
    to the smaller index here and as torch.topk likes there, so each cut is checked to fall
    between distinct scores (8 index heads make an all-zero score rare)."""
    import hebrus.ops.v4 as v4
    cuts = []

    def untied_top_k(scores, k):
        ranked = scores.sort(dim=-1, descending=True).values[0]
        assert k == ranked.numel() or ranked[k - 1] > ranked[k], f"a tie at the indexer's cut: {ranked.tolist()}"
        cuts.append(k < ranked.numel())
        return top_k(scores, k)

    monkeypatch.setattr(v4, "top_k", untied_top_k)
    from transformers import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask
    from foreign import float64_everywhere
    from hebrus.ops.v4 import fresh_state, interleaved_tables, step
    config, layer, rotary = _attention(layer_type)
    shape, w = _shape(layer_type), _weights(layer)
    main, compress = interleaved_tables(4, 10000.0, 64, torch.float64), interleaved_tables(4, 160000.0, 64, torch.float64)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(sum(chunks), 16, generator=gen, dtype=torch.float64)
    empty = torch.zeros(0, 8, dtype=torch.float64)
    state = {"rows": empty, "entries": empty, "keys": torch.zeros(0, 4, dtype=torch.float64),
             "compressor": fresh_state(8, shape.rate, shape.overlap, torch.float64),
             "indexer": fresh_state(4, shape.rate, True, torch.float64)} if shape.rate else {"rows": empty}
    cache, start = DynamicCache(config=config), 0
    for n in chunks:
        x, positions = h[start:start + n][None], torch.arange(start, start + n)[None]
        with torch.no_grad(), float64_everywhere():
            mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None,
                                                     cache=cache, position_ids=positions)
            embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
            want = layer(x, embeddings, positions, mask, cache=cache)[0][0]
        got = []
        for t in range(start, start + n):
            y, state = step(w, shape, state, h[t], t, main, compress)
            got.append(y)
        got = torch.stack(got)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (start, float((got - want).abs().max()))
        start += n
    if shape.rate:
        assert sum(chunks) // shape.rate >= 5 and state["entries"].abs().sum(-1).count_nonzero() == sum(chunks) // shape.rate
    assert any(cuts) == shape.overlap                          # CSA: some queries keep fewer than they see


# ---- the attention kinds in the engine ----------------------------------------------------------

def _v4_attention_model(mode: str, dtype=torch.float64):
    """The tiny preset with DeepSeek-V4's attention kinds as its mixers (a sliding window, HCA,
    CSA twice; windows of 5, entries every 4 and 3 positions), its four-stream residual, random
    weights."""
    import hebrus
    from hebrus.layers.layout import init_parameters
    from hebrus.layers.v4_attention import V4AttentionSection
    from hebrus.runtime import Model
    tiny = hebrus.load("tiny")
    section = V4AttentionSection(heads=4, head_dim=8, rope_dim=4, q_rank=6, window=5, groups=2, group_rank=5,
                                 theta=1e4, compress_theta=1.6e5, hca_rate=4, csa_rate=3, index_heads=8, index_dim=4,
                                 index_topk=2)
    spec = tiny.spec.replace(mixers=("swa", "hca", "csa", "csa"), sections=tiny.spec.sections + (section,))
    params = {name: t.to(dtype) if t.is_floating_point() else t for name, t in init_parameters(spec, 7).items()}
    return Model._placed(tiny.config, spec, params, tiny.device, dtype, mode)


def test_v4_attention_layers_give_the_same_bits_however_the_prompt_is_chunked():
    """Exact mode: a prompt whole, in chunks that end inside windows, and token by token give the
    same logits and the same state, bit for bit; fast mode is near it."""
    model = _v4_attention_model("exact")
    ids = [(7 * i + 3) % 250 + 1 for i in range(29)]
    runs = []
    for size in (29, 5, 1):
        s = model.session()
        for a in range(0, len(ids), size):
            logits = s.feed(ids[a:a + size])
        runs.append((s.digest(), logits))
    assert all(d == runs[0][0] and torch.equal(x, runs[0][1]) for d, x in runs)
    fast = _v4_attention_model("fast").session()
    torch.testing.assert_close(fast.feed(ids), runs[0][1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_each_v4_attention_stage_is_the_definition(mode, monkeypatch):
    """Each layer's stage, over a prompt in chunks, against `ops.v4.step` run position by position
    on the normed inputs the stage was given and the same weights: the same outputs."""
    from hebrus.layers.v4_attention import V4Attention
    from hebrus.ops.v4 import Shape, fresh_state, step
    model = _v4_attention_model(mode)
    seen: dict[str, list] = {}
    original = V4Attention._session

    def recorded(self, at, h, state, logs, each):
        y, state = original(self, at, h, state, logs, each)
        seen.setdefault(self.name, []).append((h.clone(), y.clone()))
        return y, state

    monkeypatch.setattr(V4Attention, "_session", recorded)
    s = model.session()
    for chunk in ([5, 9, 2, 7, 11, 3], [4], [8, 1, 6, 2, 2, 9, 5]):
        s.feed(chunk)
    stages = {stage.name: stage for stage in model.stages if isinstance(stage, V4Attention)}
    assert len(stages) == 4 and set(seen) == set(stages)
    for name, stage in stages.items():
        a, w = stage.a, stage.w
        m = stage.rate
        shape = Shape(a.heads, a.head_dim, a.rope_dim, a.window, a.groups, model.spec.rms_norm_eps, m, stage.overlap,
                      a.index_heads, a.index_dim, a.index_topk)
        roles = {"q_a": "q_a.weight", "q_a_norm": "q_a_norm.weight", "q_b": "q_b.weight", "kv": "kv.weight",
                 "kv_norm": "kv_norm.weight", "sinks": "sinks", "o_a": "o_a.weight", "o_b": "o_b.weight"}
        for role, prefix in (("c_", "compressor."), ("i_", "indexer.")):
            roles |= {role + leaf: prefix + leaf + (".weight" if leaf != "bias" else "") for leaf in ("kv", "gate", "bias", "norm")}
        roles |= {"i_q_b": "indexer.q_b.weight", "i_weights": "indexer.weights.weight"}
        weights = {role: w[leaf] for role, leaf in roles.items() if leaf in w}
        empty = torch.zeros(0, a.head_dim, dtype=torch.float64)
        state = {"rows": empty, "entries": empty, "keys": torch.zeros(0, a.index_dim, dtype=torch.float64),
                 "compressor": fresh_state(a.head_dim, m, stage.overlap, torch.float64),
                 "indexer": fresh_state(a.index_dim, m, True, torch.float64)} if m else {"rows": empty}
        hs = torch.cat([h for h, _ in seen[name]])
        ys = torch.cat([y for _, y in seen[name]])
        want = []
        for t in range(hs.shape[0]):
            y, state = step(weights, shape, state, hs[t], t, stage.tables if not m else None, stage.compress)
            want.append(y)
        assert torch.allclose(ys, torch.stack(want), rtol=1e-12, atol=1e-12), (name, float((ys - torch.stack(want)).abs().max()))


def test_v4_attention_takes_eager_steps_only():
    from hebrus.errors import InvalidInput
    model = _v4_attention_model("fast")
    with pytest.raises(InvalidInput, match="positions on the host"):
        model.session(decode="planned")
    assert model.session(decode="auto")._steps is None


@pytest.mark.parametrize("kind", ["nonfinite", "structural", "status"])
def test_a_failed_chunk_leaves_v4_attention_state_as_it_was(kind):
    """A chunk failing at any of the V4 layers' stages, partway through a window: the session's
    digest and its next logits are those of a session that never saw the chunk."""
    from hebrus import faults
    from hebrus.errors import ChunkAborted
    model = _v4_attention_model("exact")
    ids = [(5 * i + 1) % 250 + 1 for i in range(10)]
    clean, failing = model.session(), model.session()
    clean.feed(ids)
    failing.feed(ids)
    stages = [name for name in model.stage_names if name.split(".")[-1] in ("swa", "hca", "csa")]
    assert len(stages) == 4
    for stage in stages:
        before = failing.digest()
        with faults.inject(stage, kind), pytest.raises(ChunkAborted):
            failing.feed([3, 4, 5])
        assert failing.digest() == before, stage
    assert torch.equal(failing.feed([9, 8]), clean.feed([9, 8])) and failing.digest() == clean.digest()


# ---- the family ---------------------------------------------------------------------------------

def test_v4_state_matches_transformers_cache_in_float64(tmp_path):
    """After a prompt that ends inside windows, every owner transformers' cache has a value for,
    within 1e-12 in float64 (`foreign.v4_cache_pairs`: each layer's last window - 1 rows, the
    compressed entries and the indexer's keys, the open window's tokens, CSA's previous
    window's first series)."""
    from foreign import build, v4_cache_pairs
    folder, model = build("deepseek_v4", tmp_path)
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    checked = 0
    for quantity, ours, theirs in v4_cache_pairs(folder, model, ids):
        assert ours.shape == theirs.shape and torch.allclose(ours, theirs.to(ours.dtype), rtol=1e-12, atol=1e-12), \
            (quantity, float((ours - theirs).abs().max()))
        checked += 1
    assert checked == 1 + (1 + 3) + 2 * (1 + 2 * 4)          # swa, hca, two csa layers


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]])
def test_verify_passes_for_the_family(tmp_path, quantize):
    from foreign import build
    from hebrus.cli import main
    folder, _ = build("deepseek_v4", tmp_path)
    assert main(["verify", "--model", str(folder), *quantize]) == 0


def test_mtp_layers_are_left_unread_and_info_says_so(tmp_path, capsys):
    """A checkpoint with multi-token-prediction layers (their tensors under `mtp.`) loads as
    without them, and `hebrus info` names what it did not read."""
    import json
    from safetensors.torch import load_file, save_file
    import hebrus
    from foreign import build
    from hebrus.cli import main
    folder, _ = build("deepseek_v4", tmp_path)
    before = hebrus.load(folder).session().feed([1, 2, 3])
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors | {"mtp.0.attn.wq_a.weight": torch.zeros(12, 40)}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    assert torch.equal(hebrus.load(folder).session().feed([1, 2, 3]), before)
    assert main(["info", "--model", str(folder)]) == 0
    assert "1 multi-token-prediction layer(s)" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"main": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4},
                          "compress": {"rope_type": "default", "rope_theta": 1.6e5}}}, "main has rope_type 'yarn'"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "longrope", "rope_theta": 1.6e5}}}, "rope_type 'longrope'"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 9}, "exceeds n_routed_experts"),
    ({"compress_rates": [4, 128]}, "compress_rates must be an object"),
    ({"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4"}}, "FP4")])
def test_configs_it_cannot_run_are_refused_by_name(tmp_path, change, message):
    import json
    import hebrus
    from foreign import build
    folder, _ = build("deepseek_v4", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(hebrus.InvalidInput, match=message):
        hebrus.load(folder)


def test_a_random_checkpoint_of_the_bench_shape_loads(tmp_path, monkeypatch):
    """The bench's DeepSeek-V4 shape at a tiny width: written in the release's layout (its
    token-to-experts tables as integers, distinct experts a token), loaded through the importer."""
    import hebrus
    from hebrus.bench import shapes
    tiny = dict(shapes.SHAPES["deepseek-v4-3b"], vocab_size=300, hidden_size=32, num_hidden_layers=5,
                num_attention_heads=2, head_dim=16, qk_rope_head_dim=4, q_lora_rank=8, o_groups=2, o_lora_rank=8,
                sliding_window=6, compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 5},
                index_n_heads=4, index_head_dim=8, index_topk=3, n_routed_experts=6, moe_intermediate_size=16,
                max_position_embeddings=128)
    monkeypatch.setitem(shapes.SHAPES, "tiny-v4", tiny)
    model = hebrus.load(shapes.random_checkpoint("tiny-v4", tmp_path))
    table = dict(model.named_parameters())["layers.0.hash_moe.router.table"]
    assert table.dtype == torch.int64 and all(len(set(row)) == 4 for row in table.tolist())
    assert model.spec.mixers == ("hca", "hca", "hca", "csa", "hca")
    assert torch.isfinite(model.session().feed(list(range(1, 40)))).all()


def test_another_pattern_with_four_streams_matches_transformers_and_splits_anywhere(tmp_path):
    """CSA first, then the window alone, HCA and CSA, hash routing in the second layer, four
    residual streams: a 64-token prompt's logits within 1e-12 of transformers' in float64, and
    the prompt split in two at every position (every offset into every window) gives the same
    bits and state in exact mode."""
    import hebrus
    from foreign import build, float64_everywhere, in_float64
    folder, model = build("deepseek_v4", tmp_path, seed=4, hc_mult=4,
                          layer_types=["compressed_sparse_attention", "sliding_attention",
                                       "heavily_compressed_attention", "compressed_sparse_attention"],
                          mlp_layer_types=["moe", "hash_moe", "moe", "moe"])
    ids = torch.randint(0, 101, (64,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad(), float64_everywhere():
        want = in_float64(model)(torch.tensor([ids])).logits[0]
    wide = hebrus.load(folder, dtype=torch.float64)
    whole = wide.session()
    got = whole.feed(ids)
    assert float((got - want[-1]).abs().max() / want[-1].abs().max()) <= 1e-12
    exact = hebrus.load(folder, mode="exact")
    reference = exact.session()
    last = reference.feed(ids)
    for cut in range(1, len(ids)):
        s = exact.session()
        s.feed(ids[:cut])
        assert torch.equal(s.feed(ids[cut:]), last) and s.digest() == reference.digest(), cut


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunks", [(1,) * 17, (2, 7, 1, 3, 4), (17,), (5, 12)])
def test_a_compressor_over_a_chunk_at_once_is_its_walk(overlap, chunks):
    """`walk_chunk` against `walk`, chunk after chunk from the same state: the same entry rows
    and the same state after each chunk (its open window's slots, CSA's previous window)."""
    from hebrus.ops.v4 import fresh_state, interleaved_tables, walk, walk_chunk
    gen = torch.Generator().manual_seed(8)
    rate, d = 3, 4
    c = 2 * d if overlap else d
    kv = torch.randn(sum(chunks), c, generator=gen, dtype=torch.float64)
    gate = torch.randn(sum(chunks), c, generator=gen, dtype=torch.float64)
    norm = torch.randn(d, generator=gen, dtype=torch.float64)
    cos, sin = interleaved_tables(2, 1e4, 32, torch.float64)
    one = many = fresh_state(d, rate, overlap, torch.float64)
    start, closing = 0, 0
    for n in chunks:
        part = slice(start, start + n)
        rows, one = walk(kv[part], gate[part], one, start, rate, overlap, norm, 1e-6, cos, sin)
        fast, many = walk_chunk(kv[part], gate[part], many, start, rate, overlap, norm, 1e-6, cos, sin)
        assert torch.allclose(fast, rows, rtol=1e-12, atol=1e-12)
        for a, b in zip(one, many):
            assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12)
        closing += int(fast.abs().sum(-1).count_nonzero())
        start += n
    assert closing == sum(chunks) // rate                     # every window closed, in whichever chunk


@pytest.mark.parametrize("tile", [1, 3, 128])
def test_a_chunk_of_queries_in_tiles_is_each_query_alone(tile, monkeypatch):
    """`attend_chunk` and `choose_chunk` in tiles of any size, queries from mid-stream: each
    query as `sink_attention` and `choose` have it alone (HCA: every entry it sees; CSA: its
    picks), within 1e-12."""
    import hebrus.ops.v4 as v4
    monkeypatch.setattr(v4, "TILE", tile)
    gen = torch.Generator().manual_seed(9)
    H, d, window, rate, start, T = 3, 8, 5, 3, 11, 10
    q = torch.randn(T, H, d, generator=gen, dtype=torch.float64)
    rows = torch.randn(start + T, d, generator=gen, dtype=torch.float64)
    entries = torch.randn((start + T) // rate, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    qi = torch.randn(T, 16, 4, generator=gen, dtype=torch.float64)
    weights = torch.randn(T, 16, generator=gen, dtype=torch.float64)
    keys = torch.randn(entries.shape[0], 4, generator=gen, dtype=torch.float64)
    chosen = v4.choose_chunk(qi, weights, keys, start, rate, 2, 0.5)
    first = start - window + 1
    for picks in (None, chosen):
        got = v4.attend_chunk(q, rows[first:], first, start, window, sinks, 0.3, entries, rate, picks)
        for j in range(T):
            t = start + j
            mine = entries[:(t + 1) // rate]
            if picks is not None:
                alone = v4.choose(qi[j], weights[j], keys[:(t + 1) // rate], 2, 0.5)
                assert chosen[j, :len(alone)].tolist() == alone.tolist() and (chosen[j, len(alone):] == -1).all()
                mine = mine[alone]
            want = v4.sink_attention(q[j], torch.cat([rows[t - window + 1:t + 1], mine]), sinks, 0.3)
            assert torch.allclose(got[j], want, rtol=1e-12, atol=1e-12), (picks is None, j)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_v4_sessions_stepping_together_are_each_alone(mode):
    """Three sessions at different positions (windows open at different slots) fed together,
    a token each and then chunks of different lengths: each one's logits and state as when fed
    alone (the same bits in exact mode)."""
    import hebrus
    model = _v4_attention_model(mode)
    prompts = [[(3 * i + k) % 250 + 1 for i in range(n)] for k, n in ((1, 7), (2, 12), (3, 4))]
    together, alone = [model.session() for _ in prompts], [model.session() for _ in prompts]
    for s, a, p in zip(together, alone, prompts):
        s.feed(p)
        a.feed(p)
    batch = hebrus.Batch(together)
    for step in ([5, 6, 7], [[1, 2], [3], [4, 5, 6, 7, 8]], [9, 9, 9]):
        got = batch.feed(step)
        for s, a, ids, logits in zip(together, alone, step, got):
            want = a.feed(ids if isinstance(ids, list) else [ids])
            if mode == "exact":
                assert torch.equal(logits, want) and s.digest() == a.digest()
            else:
                torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)


def test_yarn_on_the_compressing_layers_matches_transformers(tmp_path):
    """A config with YaRN (transformers applies it to the compressing layers only, attention
    factor 1): the prompt's logits and 8 greedy steps within 1e-12 of transformers' in float64,
    and the compressing layers' rotation is not the plain one."""
    import hebrus
    from foreign import build, float64_everywhere, in_float64, reference_run
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
    folder, model = build("deepseek_v4", tmp_path, rope_parameters=yarn)
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    with float64_everywhere():
        prompt_logits, _, tokens, step_logits = reference_run(in_float64(model), ids, 8)
    ours = hebrus.load(folder, dtype=torch.float64)
    section = next(s for s in ours.spec.sections if type(s).__name__ == "V4AttentionSection")
    assert section.yarn_factor == 4.0 and section.yarn_original == 64
    session = ours.session()
    for a in range(0, 23, 6):
        logits = session.feed(ids[a:a + 6])
        want = prompt_logits[min(a + 6, 23) - 1]
        assert float((logits - want).abs().max() / want.abs().max()) <= 1e-12
    for step in range(8):
        assert float((session.logits - step_logits[step]).abs().max() / step_logits[step].abs().max()) <= 1e-12
        session.feed([tokens[step]])
    plain = hebrus.load(build("deepseek_v4", tmp_path / "plain")[0], dtype=torch.float64).session().feed(ids)
    assert not torch.allclose(plain, prompt_logits[-1], rtol=1e-6, atol=1e-6)


def test_v4_sessions_interleaved_are_each_alone():
    """Two sessions fed in turn, chunks of different lengths crossing windows, a fork of one
    taken midway and fed on: each one's logits and state as when fed alone (exact mode, bits)."""
    model = _v4_attention_model("exact")
    a_chunks, b_chunks = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]], [[20, 21], [22], [23, 24, 25, 26], [27, 28, 29]]
    a, b = model.session(), model.session()
    fork = None
    for i, (x, y) in enumerate(zip(a_chunks, b_chunks)):
        a.feed(x)
        if i == 1:
            fork = a.fork()
        b.feed(y)
    fork.feed([30, 31, 32])
    for chunks, session in ((a_chunks, a), (b_chunks, b), (a_chunks[:2] + [[30, 31, 32]], fork)):
        alone = model.session()
        for chunk in chunks:
            last = alone.feed(chunk)
        assert torch.equal(last, session.logits) and alone.digest() == session.digest()


def test_a_v4_session_saved_inside_a_window_restores_and_goes_on(tmp_path):
    """Saved with windows open (its partial windows are banked state), restored: the same
    digest, and the same logits and state from there on."""
    model = _v4_attention_model("exact")
    s = model.session()
    s.feed([(11 * i) % 250 + 1 for i in range(13)])           # 13: inside windows of 3, 4 and 5
    s.save(tmp_path / "s")
    back = model.restore(tmp_path / "s")
    assert back.digest() == s.digest() and torch.equal(back.logits, s.logits)
    assert torch.equal(back.feed([7, 8, 9, 10]), s.feed([7, 8, 9, 10])) and back.digest() == s.digest()
