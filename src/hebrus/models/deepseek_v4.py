"""DeepSeek-V4: attention over a sliding window of shared K = V rows, with compressed entries in
most layers (`sliding_attention`, `heavily_compressed_attention`, `compressed_sparse_attention`:
the `swa`, `hca` and `csa` kinds of `layers.v4_attention`); hash-routed experts in the first
layers and √softplus-routed ones after (`hash_moe`, `moe`), SwiGLU clipped, with a shared
expert; the manifold-constrained hyper-connection residual of `hc_mult` streams and its head
(the Hebrus model's `hyper` residual); plain-weight RMSNorms.

Read: the release's layout and transformers' (`save_pretrained` writes the release's), with
YaRN on the compressing layers' rotation. Refused, by name: any other rotary scaling, attention
biases, other activations; FP4 expert weights are out of scope. A checkpoint's multi-token-prediction layers are not read
(`num_nextn_predict_layers`: speculative decoding does not use them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from hebrus.errors import InvalidInput
from hebrus.layers.kind import KINDS
from hebrus.layers.moe import ExpertsSection
from hebrus.layers.spec import ModelSpec
from hebrus.layers.v4_attention import V4AttentionSection
from hebrus.models.layout import INTEGER_DTYPES
from hebrus.models.qwen import add_mlp
from hebrus.show import shown
from hebrus.weights.limits import MAX_HEADS, MAX_ROWS, MAX_WIDTH, bounded, field_problems, from_json, json_kind
from hebrus.weights.table import FLOAT_DTYPES, NamesTable

NAME = "deepseek_v4"
MODEL_TYPES = ("deepseek_v4",)
TOOL_CALLS = "dsml"         # how its models write tool calls (`hebrus.text.tools`)

LAYER_KINDS = ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention")
MIXERS = {"sliding_attention": "swa", "heavily_compressed_attention": "hca", "compressed_sparse_attention": "csa"}
FFN_KINDS = ("hash_moe", "moe")
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}    # transformers' defaults


@dataclass(slots=True)
class DeepseekV4Config:
    """The config keys the model reads (transformers' names), each checked."""
    vocab_size: int = bounded(1, MAX_ROWS)
    hidden_size: int = bounded(1, MAX_WIDTH)
    num_hidden_layers: int = bounded(1, 1024)
    num_attention_heads: int = bounded(1, MAX_HEADS)
    head_dim: int = bounded(2, MAX_WIDTH)
    q_lora_rank: int = bounded(1, MAX_WIDTH)
    qk_rope_head_dim: int = bounded(2, MAX_WIDTH)
    layer_types: tuple[str, ...] = bounded(choices=LAYER_KINDS)
    mlp_layer_types: tuple[str, ...] = bounded(choices=FFN_KINDS)
    moe_intermediate_size: int = bounded(1, 2**18)
    n_routed_experts: int = bounded(1, 4096)
    num_experts_per_tok: int = bounded(1, 4096)
    n_shared_experts: int = bounded(0, 64, 1)
    norm_topk_prob: bool = bounded(default=True)
    routed_scaling_factor: float = bounded(0, math.inf, 1.0, open_low=True)
    scoring_func: str = bounded(default="sqrtsoftplus", choices=("sqrtsoftplus", "softmax", "sigmoid"))
    swiglu_limit: float = bounded(0, math.inf, 0.0)
    num_key_value_heads: int = bounded(1, 1, 1)               # one shared K = V head: nothing else exists
    sliding_window: int = bounded(1, 2**20, 128)
    csa_rate: int = bounded(1, 2**16, RATES["compressed_sparse_attention"])
    hca_rate: int = bounded(1, 2**16, RATES["heavily_compressed_attention"])
    o_groups: int = bounded(1, MAX_HEADS, 1)
    o_lora_rank: int = bounded(1, MAX_WIDTH, 1)
    index_n_heads: int = bounded(1, MAX_HEADS, 1)
    index_head_dim: int = bounded(2, MAX_WIDTH, 2)
    index_topk: int = bounded(1, 2**20, 1)
    rope_theta: float = bounded(0, math.inf, 10000.0, open_low=True)
    compress_rope_theta: float = bounded(0, math.inf, 160000.0, open_low=True)
    hc_mult: int = bounded(1, 64, 4)
    hc_sinkhorn_iters: int = bounded(1, 1000, 20)
    hc_eps: float = bounded(0, 1, 1e-6, open_low=True)
    rms_norm_eps: float = bounded(0, 1, 1e-6, open_low=True)
    max_position_embeddings: int = bounded(1, 2**20, 1048576)
    tie_word_embeddings: bool = bounded(default=False)
    hidden_act: str = bounded(default="silu", choices=("silu",))
    attention_bias: bool = bounded(default=False)
    mlp_bias: bool = bounded(default=False)
    num_nextn_predict_layers: int = bounded(0, 64, 0)        # read for `hebrus info`; the layers are not
    yarn_factor: float = bounded(0, 2**20, 0.0)               # YaRN on the compressing layers (0: none)
    yarn_original: int = bounded(0, 2**24, 0)
    yarn_beta_fast: float = bounded(0, 2**20, 32.0, open_low=True)
    yarn_beta_slow: float = bounded(0, 2**20, 1.0, open_low=True)
    yarn_truncate: bool = bounded(default=True)
    yarn_attention: float = bounded(0, 2**10, 1.0, open_low=True)

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not problems:
            problems = list(self._shape_problems())
        if problems:
            raise InvalidInput("invalid deepseek_v4 config: " + "; ".join(problems[:8]))

    def _shape_problems(self) -> Iterator[str]:
        for key in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, key)) != self.num_hidden_layers:
                yield f"{key} has {len(getattr(self, key))} entries for num_hidden_layers={self.num_hidden_layers}"
        if self.attention_bias or self.mlp_bias:
            yield "attention_bias / mlp_bias = true is not supported (DeepSeek-V4's checkpoints have no biases)"
        if self.num_experts_per_tok > self.n_routed_experts:
            yield f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"


def config(data: Any) -> DeepseekV4Config:
    """The checked config of a parsed config.json: transformers' keys, with the older spellings
    it folds in (`compress_ratios` per layer, `compress_rate_csa` / `_hca`, `num_hash_layers`,
    `partial_rotary_factor` for `qk_rope_head_dim`) and its defaults where a list is absent.
    Rotary scaling (`rope_parameters` of another type than "default") is refused."""
    if not isinstance(data, dict):
        raise InvalidInput(f"a config is a JSON object, got {json_kind(data)}")
    text = dict(data)
    quantized = text.get("quantization_config")
    experts = (quantized.get("expert_dtype") if isinstance(quantized, dict) else None) or text.get("expert_dtype")
    if experts not in (None, "fp8", "bf16", "bfloat16"):
        raise InvalidInput(f"expert weights stored as {shown(experts)} (the published checkpoints' FP4) are not "
                           f"supported; 16-bit and FP8 ones are")
    layers = text.get("num_hidden_layers")
    count = layers if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= 1024 else 0
    rates = text.pop("compress_rates", None) or {}
    if not isinstance(rates, dict):
        raise InvalidInput(f"compress_rates must be an object, got {json_kind(rates)}")
    for kind, key, old in (("compressed_sparse_attention", "csa_rate", "compress_rate_csa"),
                           ("heavily_compressed_attention", "hca_rate", "compress_rate_hca")):
        text.setdefault(key, rates.get(kind, text.get(old, RATES[kind])))
    if text.get("layer_types") is None:
        ratios = text.get("compress_ratios")
        if isinstance(ratios, list):
            by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
            if not all(r in by_ratio for r in ratios):
                raise InvalidInput(f"compress_ratios entries must be 0, 4 or 128, got {shown(ratios)}")
            text["layer_types"] = [by_ratio[r] for r in ratios][:count]
        else:                                        # transformers' default: two HCA, then CSA and HCA in turn
            text["layer_types"] = ([LAYER_KINDS[1]] * min(count, 2)
                                   + [LAYER_KINDS[2] if i % 2 else LAYER_KINDS[1] for i in range(max(count - 2, 0))])
    if text.get("mlp_layer_types") is None:
        hashed = text.get("num_hash_layers", 3)
        if not isinstance(hashed, int) or isinstance(hashed, bool) or hashed < 0:
            raise InvalidInput(f"num_hash_layers must be a non-negative integer, got {shown(hashed)}")
        text["mlp_layer_types"] = ["hash_moe"] * min(count, hashed) + ["moe"] * max(0, count - hashed)
    _rotary(text)
    return from_json(DeepseekV4Config, {k: v for k, v in text.items() if k in DeepseekV4Config.__dataclass_fields__})


def _rotary(text: dict) -> None:
    """`qk_rope_head_dim` and the two thetas from `rope_parameters` (transformers' nested "main"
    and "compress", or flat: then a scaling applies to the compressing layers, as transformers
    has it), `partial_rotary_factor` or the keys themselves; YaRN on the compressing layers read
    into `yarn_*` (its attention factor 1 unless given, as transformers sets it); any other
    scaling, or one on the sliding-window layers, refused."""
    head_dim = text.get("head_dim")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise InvalidInput(f"rope_parameters must be an object, got {json_kind(rope)}")
    nested = {label: rope[label] for label in ("main", "compress") if isinstance(rope.get(label), dict)}
    main, compress = (nested.get("main", {}), nested.get("compress", {})) if nested else ({}, rope)
    for label, params in (("main", main), ("compress", compress)):
        kind = params.get("rope_type", params.get("type", "default"))
        allowed = ("default", "yarn") if label == "compress" else ("default",)
        if kind not in allowed:
            raise InvalidInput(f"rope_parameters{'.' + label if nested else ''} has rope_type {shown(kind)}: "
                               f"{' or '.join(repr(k) for k in allowed)} is supported there")
    if "rope_theta" in main:
        text["rope_theta"] = main["rope_theta"]
    if nested and "rope_theta" in compress:
        text["compress_rope_theta"] = compress["rope_theta"]
    if compress.get("rope_type", compress.get("type")) == "yarn":
        factor = compress.get("factor")
        original = compress.get("original_max_position_embeddings")
        if factor is None and isinstance(original, int) and original > 0:
            factor = text.get("max_position_embeddings", 1048576) / original
        text |= {"yarn_factor": factor, "yarn_original": original, "yarn_beta_fast": compress.get("beta_fast") or 32.0,
                 "yarn_beta_slow": compress.get("beta_slow") or 1.0, "yarn_truncate": rope.get("truncate", True),
                 "yarn_attention": compress.get("attention_factor", 1.0)}
        for key in ("mscale", "mscale_all_dim"):
            if compress.get(key) and "attention_factor" not in compress:
                raise InvalidInput(f"rope_parameters: YaRN's {key} without an attention_factor is not supported")
    factor = text.get("partial_rotary_factor") or next((p.get("partial_rotary_factor") for p in nested.values()), None)
    if "qk_rope_head_dim" not in text:
        if factor is None:
            factor = 64 / 512                         # transformers' default
        if not isinstance(head_dim, int) or isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise InvalidInput(f"head_dim and partial_rotary_factor must be numbers, got {shown(head_dim)}, {shown(factor)}")
        text["qk_rope_head_dim"] = int(head_dim * factor)


def spec(c: DeepseekV4Config) -> ModelSpec:
    """The layers' spec: the attention section (a compress rate only where its layers are), the
    experts' (√softplus scores, scaled, clipped, an ungated shared expert)."""
    mixers = tuple(MIXERS[kind] for kind in c.layer_types)
    csa = "csa" in mixers
    attention = V4AttentionSection(
        heads=c.num_attention_heads, head_dim=c.head_dim, rope_dim=c.qk_rope_head_dim, q_rank=c.q_lora_rank,
        window=c.sliding_window, groups=c.o_groups, group_rank=c.o_lora_rank, theta=c.rope_theta,
        compress_theta=c.compress_rope_theta, hca_rate=c.hca_rate if "hca" in mixers else 0,
        csa_rate=c.csa_rate if csa else 0, index_heads=c.index_n_heads if csa else 0,
        index_dim=c.index_head_dim if csa else 0, index_topk=c.index_topk if csa else 0,
        yarn_factor=c.yarn_factor, yarn_original=c.yarn_original, yarn_beta_fast=c.yarn_beta_fast,
        yarn_beta_slow=c.yarn_beta_slow, yarn_truncate=c.yarn_truncate, yarn_attention=c.yarn_attention)
    experts = ExpertsSection(c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                             c.moe_intermediate_size * c.n_shared_experts, c.norm_topk_prob, shared_gated=False,
                             scoring=c.scoring_func, scale=c.routed_scaling_factor, limit=c.swiglu_limit or None)
    return ModelSpec(
        family=NAME, vocab_size=c.vocab_size, hidden_size=c.hidden_size, mixers=mixers, ffns=tuple(c.mlp_layer_types),
        max_context=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, tie_embeddings=c.tie_word_embeddings,
        residual="hyper", hc_streams=c.hc_mult, hc_sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps,
        sections=(attention, experts))


# ---- names -------------------------------------------------------------------------------------

# each attention weight's leaf -> (the release's name under the layer's `attn.`, transformers' under `self_attn.`)
ATTENTION = {"q_a.weight": ("wq_a.weight", "q_a_proj.weight"), "q_a_norm.weight": ("q_norm.weight", "q_a_norm.weight"),
             "q_b.weight": ("wq_b.weight", "q_b_proj.weight"), "kv.weight": ("wkv.weight", "kv_proj.weight"),
             "kv_norm.weight": ("norm.weight", "kv_norm.weight"), "sinks": ("attn_sink", "sinks"),
             "o_a.weight": ("wo_a.weight", "o_a_proj.weight"), "o_b.weight": ("wo_b.weight", "o_b_proj.weight"),
             "compressor.kv.weight": ("compressor.wkv.weight", "compressor.kv_proj.weight"),
             "compressor.gate.weight": ("compressor.wgate.weight", "compressor.gate_proj.weight"),
             "compressor.bias": ("compressor.ape", "compressor.position_bias"),
             "compressor.norm.weight": ("compressor.norm.weight", "compressor.kv_norm.weight"),
             "indexer.kv.weight": ("indexer.compressor.wkv.weight", "compressor.indexer.kv_proj.weight"),
             "indexer.gate.weight": ("indexer.compressor.wgate.weight", "compressor.indexer.gate_proj.weight"),
             "indexer.bias": ("indexer.compressor.ape", "compressor.indexer.position_bias"),
             "indexer.norm.weight": ("indexer.compressor.norm.weight", "compressor.indexer.kv_norm.weight"),
             "indexer.q_b.weight": ("indexer.wq_b.weight", "compressor.indexer.q_b_proj.weight"),
             "indexer.weights.weight": ("indexer.weights_proj.weight", "compressor.indexer.scorer.weights_proj.weight")}


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    """Embedding, the head's norm and mix-down, the head; each layer's norms, residual mixes,
    attention and experts. Two layouts are read: the release's (`attn.wq_a`, `ffn.experts.E.w1`,
    `hc_attn_fn`, `head.weight`; with or without a `model.` prefix, as transformers'
    `save_pretrained` writes it) and transformers' in memory (`self_attn.q_a_proj`,
    `mlp.experts.gate_up_proj`, `attn_hc.fn`, `lm_head.weight`)."""
    def named(*spellings: str) -> str:
        """The first spelling the checkpoint has (the first if none: the error names it)."""
        return next((name for name in spellings if name in on_disk), spellings[0])

    D, V, n = s.hidden_size, s.vocab_size, s.hc_streams
    root = "model." if any(name.startswith("model.") for name in on_disk) else ""
    t = NamesTable({}, {}, ignored=lambda name: name.startswith(("mtp.", "model.mtp.")))   # not read: see `config`
    t.add("embed.weight", named(root + "embed_tokens.weight", root + "embed.weight"), (V, D))
    t.add("norm.weight", named(root + "norm.weight"), (D,))
    if not s.tie_embeddings:
        t.add("lm_head.weight", named("head.weight", "lm_head.weight", root + "head.weight"), (V, D))
    for leaf, shape in (("fn", (n, n * D)), ("base", (n,)), ("scale", (1,))):
        t.add(f"head_hc.{leaf}", named(f"{root}hc_head.hc_{leaf}", f"{root}hc_head_{leaf}"), shape)
    e = s.section(ExpertsSection)
    E, I = e.experts, e.intermediate
    tables: set[str] = set()                    # the token-to-experts tables: stored as integers
    t.dtypes = lambda name: INTEGER_DTYPES if name in tables else FLOAT_DTYPES
    for layer, (mixer, ffn) in enumerate(zip(s.mixers, s.ffns)):
        f, m = f"{root}layers.{layer}.", f"layers.{layer}."
        t.add(m + "mixer_norm.weight", named(f + "attn_norm.weight", f + "input_layernorm.weight"), (D,))
        t.add(m + "ffn_norm.weight", named(f + "ffn_norm.weight", f + "post_attention_layernorm.weight"), (D,))
        mix = (2 + n) * n
        for ours, theirs in (("mixer_hc", "attn"), ("ffn_hc", "ffn")):
            for leaf, shape in (("fn", (mix, n * D)), ("base", (mix,)), ("scale", (3,))):
                t.add(f"{m}{ours}.{leaf}", named(f"{f}hc_{theirs}_{leaf}", f"{f}{theirs}_hc.{leaf}"), shape)
        prefix = f"{m}{mixer}."
        for name, shape in KINDS[mixer].weights(s, prefix).items():
            release, loaded = ATTENTION[name.removeprefix(prefix)]
            t.add(name, named(f + "attn." + release, f + "self_attn." + loaded), shape)
        g = f + ("mlp." if any(name.startswith(f + "mlp.") for name in on_disk) else "ffn.")
        x = f"{m}{ffn}."
        t.add(x + "router.weight", g + "gate.weight", (E, D))
        if ffn == "hash_moe":
            t.add(x + "router.table", g + "gate.tid2eid", (V, e.top_k))
            tables.add(g + "gate.tid2eid")
        else:
            t.add(x + "router.bias", named(g + "gate.bias", g + "gate.e_score_correction_bias"), (E,))
        if g + "experts.gate_up_proj" in on_disk:
            t.add(x + "experts.gate_up", g + "experts.gate_up_proj", (E, 2 * I, D))
            t.add(x + "experts.down", g + "experts.down_proj", (E, D, I))
        else:                                   # the release's: w1 gate, w3 up, w2 down, per expert
            gates = {f"{g}experts.{k}.w1.weight": (I, D) for k in range(E)}
            ups = {f"{g}experts.{k}.w3.weight": (I, D) for k in range(E)}
            t.add_source(x + "experts.gate_up", gates | ups,
                         lambda *w, E=E: torch.cat([torch.stack(w[:E]), torch.stack(w[E:])], dim=1),
                         part=lambda out, i, E=E, I=I: out[i % E, (i // E) * I:(i // E + 1) * I])
            t.add_source(x + "experts.down", {f"{g}experts.{k}.w2.weight": (D, I) for k in range(E)},
                         lambda *w: torch.stack(w), part=lambda out, i: out[i])
        if e.shared_intermediate:
            h = e.shared_intermediate
            if g + "shared_experts.w1.weight" in on_disk:
                for ours, theirs, shape in (("gate_proj", "w1", (h, D)), ("up_proj", "w3", (h, D)),
                                            ("down_proj", "w2", (D, h))):
                    t.add(f"{x}shared.{ours}.weight", f"{g}shared_experts.{theirs}.weight", shape)
            else:
                add_mlp(t, D, h, g + "shared_experts.", x + "shared.")
    return t
