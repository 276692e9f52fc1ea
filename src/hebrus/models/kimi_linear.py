"""Kimi-Linear: Kimi delta attention ("linear_attention") and multi-head latent attention without
rotary ("full_attention") layers, a dense MLP in the first layers and routed experts (sigmoid
scores with a correction bias, grouped choice, scaled weights) with an ungated shared expert in
the rest; a plain residual and plain-weight RMSNorms.

Its checkpoints come in two layouts, both read: the release's (`linear_attn_config`, separate
q/k/v convs, `block_sparse_moe.` with per-expert w1/w2/w3) and transformers' (`layer_types`,
one conv, `mlp.experts.gate_up_proj`, the forget gate's tensors under `forget_gate.`). Config
keys are taken under either of their two names (`num_experts` or `num_local_experts`, ...).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from hebrus.errors import InvalidInput
from hebrus.layers.kda import KdaSection
from hebrus.layers.mla import LatentSection
from hebrus.layers.mlp import MLPSection
from hebrus.layers.moe import ExpertsSection
from hebrus.layers.spec import ModelSpec
from hebrus.models.qwen import add_mlp
from hebrus.show import shown
from hebrus.weights.limits import MAX_HEADS, MAX_ROWS, MAX_WIDTH, bounded, field_problems, from_json, json_kind
from hebrus.weights.table import NamesTable

NAME = "kimi_linear"
MODEL_TYPES = ("kimi_linear",)
# how its models write tool calls (`hebrus.text.tools`)
TOOL_CALLS = "kimi"

LAYER_KINDS = ("linear_attention", "full_attention")
MIXERS = {"linear_attention": "kda", "full_attention": "mla"}
FFN_KINDS = ("dense", "sparse")
# the name a key has in the release's config.json -> its name in transformers' (either is read)
ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "model_max_length": "max_position_embeddings"}


@dataclass(slots=True)
class KimiConfig:
    """The config keys the model reads (transformers' names), each checked."""
    vocab_size: int = bounded(1, MAX_ROWS)
    hidden_size: int = bounded(1, MAX_WIDTH)
    num_hidden_layers: int = bounded(1, 1024)
    num_attention_heads: int = bounded(1, MAX_HEADS)
    kv_lora_rank: int = bounded(1, MAX_WIDTH)
    qk_nope_head_dim: int = bounded(1, MAX_HEADS)
    qk_rope_head_dim: int = bounded(0, MAX_HEADS)
    v_head_dim: int = bounded(1, MAX_HEADS)
    linear_num_heads: int = bounded(1, MAX_HEADS)
    linear_head_dim: int = bounded(1, MAX_HEADS)
    layer_types: tuple[str, ...] = bounded(choices=LAYER_KINDS)
    mlp_layer_types: tuple[str, ...] = bounded(choices=FFN_KINDS)
    intermediate_size: int = bounded(1, 2**18)
    q_lora_rank: int = bounded(0, MAX_WIDTH, 0)                   # 0 (null in the file): no low-rank query
    linear_conv_kernel_dim: int = bounded(1, 64, 4)
    moe_intermediate_size: int = bounded(1, 2**18, 1)
    num_local_experts: int = bounded(0, 4096, 0)
    num_experts_per_tok: int = bounded(1, 4096, 1)
    n_shared_experts: int = bounded(0, 64, 0)
    norm_topk_prob: bool = bounded(default=True)
    n_group: int = bounded(1, 4096, 1)
    topk_group: int = bounded(1, 4096, 1)
    routed_scaling_factor: float = bounded(0, math.inf, 1.0, open_low=True)
    rms_norm_eps: float = bounded(0, 1, 1e-5, open_low=True)
    max_position_embeddings: int = bounded(1, 2**20, 32768)
    tie_word_embeddings: bool = bounded(default=False)     # read, not followed: the reference never ties its head
    hidden_act: str = bounded(default="silu", choices=("silu",))
    attention_bias: bool = bounded(default=False)
    moe_router_activation_func: str = bounded(default="sigmoid", choices=("sigmoid",))
    mla_use_nope: bool = bounded(default=True)

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not problems:
            problems = list(self._shape_problems())
        if problems:
            raise InvalidInput("invalid kimi_linear config: " + "; ".join(problems[:8]))

    def _shape_problems(self) -> Iterator[str]:
        for key in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, key)) != self.num_hidden_layers:
                yield f"{key} has {len(getattr(self, key))} entries for num_hidden_layers={self.num_hidden_layers}"
        if self.attention_bias:
            yield "attention_bias=true is not supported (Kimi-Linear's checkpoints have no biases)"
        if not self.mla_use_nope:
            yield "mla_use_nope=false (rotary latent attention) is not supported"
        if "sparse" in self.mlp_layer_types and self.num_local_experts < 1:
            yield "sparse layers need num_experts >= 1"


def config(data: Any) -> KimiConfig:
    """The checked config of a parsed config.json: either name of a key (`ALIASES`; a null
    `q_lora_rank` is none), the release's `linear_attn_config` (1-based `kda_layers` /
    `full_attn_layers`, `num_heads`, `head_dim`, `short_conv_kernel_size`) and
    `first_k_dense_replace` (default 1) where `layer_types` / `mlp_layer_types` are absent."""
    if not isinstance(data, dict):
        raise InvalidInput(f"a config is a JSON object, got {json_kind(data)}")
    text = {ALIASES.get(k, k): v for k, v in data.items()}
    if text.get("q_lora_rank", 0) is None:
        text["q_lora_rank"] = 0
    linear = text.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise InvalidInput(f"linear_attn_config must be an object, got {json_kind(linear)}")
    for key, theirs in (("linear_num_heads", "num_heads"), ("linear_head_dim", "head_dim"),
                        ("linear_conv_kernel_dim", "short_conv_kernel_size")):
        if theirs in linear:
            text[key] = linear[theirs]
    layers = text.get("num_hidden_layers")
    count = layers if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= 1024 else 0
    if text.get("layer_types") is None:
        text["layer_types"] = _layer_types(linear, count)
    if text.get("mlp_layer_types") is None:
        first = text.get("first_k_dense_replace", 1)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise InvalidInput(f"first_k_dense_replace must be a non-negative integer, got {shown(first)}")
        text["mlp_layer_types"] = [FFN_KINDS[i >= first] for i in range(count)]
    return from_json(KimiConfig, text)


def _layer_types(linear: dict, count: int) -> list[str]:
    """From the release's 1-based layer lists; without them every fourth layer (from the
    second) is latent attention, as transformers defaults."""
    if "full_attn_layers" not in linear or "kda_layers" not in linear:
        return [LAYER_KINDS[bool(i and i % 4 == 0)] for i in range(count)]
    kinds: list = [None] * count
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
        listed = linear[key]
        if not isinstance(listed, list) or not all(isinstance(n, int) and 1 <= n <= count for n in listed):
            raise InvalidInput(f"linear_attn_config.{key} must list layers 1..{count}, got {shown(listed)}")
        for n in listed:
            kinds[n - 1] = kind
    if None in kinds:
        raise InvalidInput(f"linear_attn_config names no kind for layer {kinds.index(None) + 1}")
    return kinds


def spec(c: KimiConfig) -> ModelSpec:
    """The layers' spec: each section only where a layer of its kind is."""
    mixers = tuple(MIXERS[kind] for kind in c.layer_types)
    ffns = tuple("moe" if kind == "sparse" else "mlp" for kind in c.mlp_layer_types)
    sections = []
    if "kda" in mixers:
        sections.append(KdaSection(c.linear_num_heads, c.linear_head_dim, c.linear_head_dim, c.linear_head_dim,
                                   c.linear_conv_kernel_dim))
    if "mla" in mixers:
        sections.append(LatentSection(c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                      c.v_head_dim, c.q_lora_rank))
    if "moe" in ffns:
        sections.append(ExpertsSection(c.num_local_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                       c.moe_intermediate_size * c.n_shared_experts, c.norm_topk_prob,
                                       shared_gated=False, scoring="sigmoid", groups=c.n_group,
                                       top_groups=c.topk_group, scale=c.routed_scaling_factor))
    if "mlp" in ffns:
        sections.append(MLPSection(c.intermediate_size))
    return ModelSpec(
        family=NAME, vocab_size=c.vocab_size, hidden_size=c.hidden_size, mixers=mixers, ffns=ffns,
        max_context=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_embeddings=False, residual="plain", hc_streams=1, sections=tuple(sections),
    )


# ---- names -------------------------------------------------------------------------------------

def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    """Embedding, norms, head, each layer's mixer and feed-forward, in either layout."""
    D, V = s.hidden_size, s.vocab_size
    t = NamesTable({}, {})
    t.add("embed.weight", "model.embed_tokens.weight", (V, D))
    t.add("norm.weight", "model.norm.weight", (D,))
    t.add("lm_head.weight", "lm_head.weight", (V, D))
    for layer, mixer in enumerate(s.mixers):
        f, m = f"model.layers.{layer}.", f"layers.{layer}."
        t.add(m + "mixer_norm.weight", f + "input_layernorm.weight", (D,))
        t.add(m + "ffn_norm.weight", f + "post_attention_layernorm.weight", (D,))
        if mixer == "kda":
            _kda(t, s, on_disk, f + "self_attn.", m + "kda.")
        else:
            _mla(t, s, f + "self_attn.", m + "mla.")
        # the release keeps feed-forward tensors under `block_sparse_moe.`, transformers under `mlp.`
        ffn = f + ("mlp." if any(name.startswith(f + "mlp.") for name in on_disk) else "block_sparse_moe.")
        if s.ffns[layer] == "moe":
            _moe(t, s, on_disk, ffn, m + "moe.")
        else:
            add_mlp(t, D, s.section(MLPSection).intermediate, ffn, m + "mlp.")
    return t


def _kda(t: NamesTable, s: ModelSpec, on_disk: set[str], f: str, m: str) -> None:
    d, D = s.section(KdaSection), s.hidden_size
    H, dk, dv, r, K = d.heads, d.key_dim, d.value_dim, d.gate_rank, d.conv_kernel
    parts = {f + "q_proj.weight": (H * dk, D), f + "k_proj.weight": (H * dk, D), f + "v_proj.weight": (H * dv, D)}
    t.add_source(m + "in_proj_qkv.weight", parts, lambda *w: torch.cat(w))
    if f + "conv1d.weight" in on_disk:
        t.add(m + "conv.weight", f + "conv1d.weight", (d.conv_dim, 1, K), lambda w: w[:, 0])
    else:
        convs = {f + "q_conv1d.weight": (H * dk, 1, K), f + "k_conv1d.weight": (H * dk, 1, K),
                 f + "v_conv1d.weight": (H * dv, 1, K)}
        t.add_source(m + "conv.weight", convs, lambda *w: torch.cat(w)[:, 0])
    gate = f + "forget_gate." if f + "forget_gate.f_a_proj.weight" in on_disk else f
    t.add(m + "f_a_proj.weight", gate + "f_a_proj.weight", (r, D))
    t.add(m + "f_b_proj.weight", gate + "f_b_proj.weight", (H * dk, r))
    t.add(m + "A_log", gate + "A_log", (1, 1, H, 1), lambda w: w.reshape(H))
    t.add(m + "dt_bias", gate + "dt_bias", (H * dk,))
    t.add(m + "b_proj.weight", f + "b_proj.weight", (H, D))
    t.add(m + "g_a_proj.weight", f + "g_a_proj.weight", (r, D))
    t.add(m + "g_b_proj.weight", f + "g_b_proj.weight", (H * dv, r))
    t.add(m + "norm.weight", f + "o_norm.weight", (dv,))
    t.add(m + "o_proj.weight", f + "o_proj.weight", (D, H * dv))


def _mla(t: NamesTable, s: ModelSpec, f: str, m: str) -> None:
    a, D = s.section(LatentSection), s.hidden_size
    H, qk = a.heads, a.nope_dim + a.rope_dim
    if a.q_rank:
        t.add(m + "q_proj.weight", f + "q_a_proj.weight", (a.q_rank, D))
        t.add(m + "q_norm.weight", f + "q_a_layernorm.weight", (a.q_rank,))
        t.add(m + "q_b_proj.weight", f + "q_b_proj.weight", (H * qk, a.q_rank))
    else:
        t.add(m + "q_proj.weight", f + "q_proj.weight", (H * qk, D))
    t.add(m + "kv_a_proj.weight", f + "kv_a_proj_with_mqa.weight", (a.row, D))
    t.add(m + "kv_norm.weight", f + "kv_a_layernorm.weight", (a.kv_rank,))
    t.add(m + "kv_b_proj.weight", f + "kv_b_proj.weight", (H * (a.nope_dim + a.value_dim), a.kv_rank))
    t.add(m + "o_proj.weight", f + "o_proj.weight", (D, H * a.value_dim))


def _moe(t: NamesTable, s: ModelSpec, on_disk: set[str], f: str, m: str) -> None:
    """Router and its correction bias, the experts (stacked, or the release's w1 gate, w3 up, w2
    down per expert), the shared expert."""
    e, D = s.section(ExpertsSection), s.hidden_size
    E, I = e.experts, e.intermediate
    t.add(m + "router.weight", f + "gate.weight", (E, D))
    t.add(m + "router.bias", f + "gate.e_score_correction_bias", (E,))
    if f + "experts.gate_up_proj" in on_disk:
        t.add(m + "experts.gate_up", f + "experts.gate_up_proj", (E, 2 * I, D))
        t.add(m + "experts.down", f + "experts.down_proj", (E, D, I))
    else:
        gates = {f"{f}experts.{n}.w1.weight": (I, D) for n in range(E)}
        ups = {f"{f}experts.{n}.w3.weight": (I, D) for n in range(E)}
        t.add_source(m + "experts.gate_up", gates | ups,
                     lambda *w: torch.cat([torch.stack(w[:E]), torch.stack(w[E:])], dim=1),
                     part=lambda out, i: out[i % E, (i // E) * I:(i // E + 1) * I])
        t.add_source(m + "experts.down", {f"{f}experts.{n}.w2.weight": (D, I) for n in range(E)},
                     lambda *w: torch.stack(w), part=lambda out, i: out[i])
    if e.shared_intermediate:
        add_mlp(t, D, e.shared_intermediate, f + "shared_experts.", m + "shared.")
