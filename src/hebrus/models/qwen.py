"""What Qwen's hybrid families share (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the text config, the
spec's common part and the names of the embedding, norms, attention and delta-rule tensors.

Their layers: a plain residual, (1 + w) RMSNorms, Gated DeltaNet ("linear_attention") and gated
full attention with partial rotary ("full_attention"), then a dense MLP or routed experts with a
gated shared expert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from hebrus.errors import InvalidInput
from hebrus.layers.attention import AttentionSection
from hebrus.layers.gdn import DeltaNetSection
from hebrus.layers.mlp import MLPSection
from hebrus.layers.moe import ExpertsSection
from hebrus.layers.spec import ModelSpec
from hebrus.show import shown
from hebrus.weights.limits import MAX_HEADS, MAX_ROWS, MAX_WIDTH, bounded, field_problems, from_json, json_kind
from hebrus.weights.table import NamesTable

LAYER_KINDS = ("linear_attention", "full_attention")
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
MIXERS = {"linear_attention": "gdn", "full_attention": "attention"}
# File tensors the text model does not use: a vision tower, multi-token-prediction layers.
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


@dataclass(slots=True)
class QwenConfig:
    """The text config keys the model reads, each checked like a Hebrus config's."""
    vocab_size: int = bounded(1, MAX_ROWS)
    hidden_size: int = bounded(1, MAX_WIDTH)
    num_hidden_layers: int = bounded(1, 1024)
    num_attention_heads: int = bounded(1, MAX_HEADS)
    num_key_value_heads: int = bounded(1, MAX_HEADS)
    head_dim: int = bounded(2, MAX_HEADS)
    linear_num_key_heads: int = bounded(1, MAX_HEADS)
    linear_num_value_heads: int = bounded(1, MAX_HEADS)
    linear_key_head_dim: int = bounded(1, MAX_HEADS)
    linear_value_head_dim: int = bounded(1, MAX_HEADS)
    layer_types: tuple[str, ...] = bounded(choices=LAYER_KINDS)
    linear_conv_kernel_dim: int = bounded(1, 64, 4)
    rms_norm_eps: float = bounded(0, 1, 1e-6, open_low=True)
    rope_theta: float = bounded(0, math.inf, 10000.0, open_low=True)
    partial_rotary_factor: float = bounded(0, 1, 0.25, open_low=True)
    max_position_embeddings: int = bounded(1, 2**20, 32768)
    tie_word_embeddings: bool = bounded(default=False)
    hidden_act: str = bounded(default="silu", choices=("silu",))
    attention_bias: bool = bounded(default=False)
    intermediate_size: int = bounded(1, 2**18, 1)
    num_experts: int = bounded(0, 4096, 0)
    num_experts_per_tok: int = bounded(1, 4096, 1)
    moe_intermediate_size: int = bounded(1, 2**18, 1)
    shared_expert_intermediate_size: int = bounded(0, 2**18, 0)
    norm_topk_prob: bool = bounded(default=True)
    decoder_sparse_step: int = bounded(1, 1024, 1)
    mlp_only_layers: tuple[int, ...] = bounded(0, 1023, ())
    model_type: str = bounded(default="qwen3_5", choices=("qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                                          "qwen3_5_moe_text", "qwen3_next"))

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not problems:
            problems = list(self._shape_problems())
        if problems:
            raise InvalidInput(f"invalid {self.model_type} config: " + "; ".join(problems[:8]))

    def _shape_problems(self) -> Iterator[str]:
        if len(self.layer_types) != self.num_hidden_layers:
            yield f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
        if self.attention_bias:
            yield "attention_bias=true is not supported (Qwen's hybrid checkpoints have no biases)"
        if self.mlp_only_layers and max(self.mlp_only_layers) >= self.num_hidden_layers:
            yield f"mlp_only_layers names a layer past num_hidden_layers={self.num_hidden_layers}"

    @classmethod
    def from_dict(cls, data: Any, required: tuple[str, ...] = ()) -> "QwenConfig":
        """The text config of a parsed config.json: the nested `text_config` of a multimodal
        checkpoint (whose top-level `tie_word_embeddings` wins, as in the reference), or the file
        itself. Unknown keys are ignored; layer_types defaults from `full_attention_interval`,
        rope settings come from `rope_parameters`. `required`: keys the family needs besides
        the shared sizes (its feed-forward sizes: no default would be right)."""
        if not isinstance(data, dict):
            raise InvalidInput(f"a config is a JSON object, got {json_kind(data)}")
        model_type = data.get("model_type")
        text = data.get("text_config", data)
        if not isinstance(text, dict):
            raise InvalidInput(f"text_config must be an object, got {json_kind(text)}")
        text = dict(text)
        if text is not data and "tie_word_embeddings" in data:
            text["tie_word_embeddings"] = data["tie_word_embeddings"]
        missing = sorted(key for key in required if key not in text)
        if missing:
            raise InvalidInput(f"config is missing required keys: {', '.join(missing)}")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise InvalidInput(f"rope_parameters must be an object, got {json_kind(rope)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise InvalidInput(f"rope_type {shown(rope_type)} is not supported; only 'default' rotary is")
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope and key not in text:
                text[key] = rope[key]
        layers = text.get("num_hidden_layers")
        if text.get("layer_types") is None and "num_hidden_layers" in text:
            interval = text.get("full_attention_interval", 4)
            if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
                raise InvalidInput(f"full_attention_interval must be a positive integer, got {shown(interval)}")
            valid = isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= 1024
            # an invalid num_hidden_layers is reported as such by the field checks
            text["layer_types"] = [LAYER_KINDS[(i + 1) % interval == 0] for i in range(layers)] if valid else []
        text["model_type"] = model_type
        if text.get("mlp_only_layers") is None:
            text.pop("mlp_only_layers", None)
        return from_json(cls, text)


def require_experts(c: QwenConfig) -> None:
    if c.num_experts < 1:
        raise InvalidInput(f"{c.model_type}: routed layers need num_experts >= 1")
    if c.num_experts_per_tok > c.num_experts:
        raise InvalidInput(f"num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts={c.num_experts}")


def spec(c: QwenConfig, family: str, ffns: tuple[str, ...], moe_normalize: bool = True) -> ModelSpec:
    """The layers' spec: each section only where a layer of its kind is."""
    mixers = tuple(MIXERS[kind] for kind in c.layer_types)
    sections = []
    if "gdn" in mixers:
        sections.append(DeltaNetSection(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                        c.linear_value_head_dim, c.linear_conv_kernel_dim))
    if "attention" in mixers:
        sections.append(AttentionSection(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                         rotary_dim=int(c.head_dim * c.partial_rotary_factor),
                                         rope_theta=c.rope_theta))
    if "moe" in ffns:
        sections.append(ExpertsSection(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                                       c.shared_expert_intermediate_size, moe_normalize))
    if "mlp" in ffns:
        sections.append(MLPSection(c.intermediate_size))
    return ModelSpec(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size, mixers=mixers, ffns=ffns,
        max_context=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_embeddings=c.tie_word_embeddings, residual="plain", hc_streams=1, sections=tuple(sections),
    )


# ---- names -------------------------------------------------------------------------------------

def plus_one(w: torch.Tensor) -> torch.Tensor:
    """Qwen's RMSNorms scale by (1 + w) and store w: the 1 is folded in here. The sum is exact in
    float64 and rounded once to the norm's storage dtype (at least float32), which is what the
    reference computes at every call."""
    return w.double() + 1


def prefix(on_disk: set[str]) -> str:
    """Where the text model's tensors live: under `model.language_model.` in the multimodal
    checkpoints, under `model.` otherwise."""
    return "model.language_model." if "model.language_model.embed_tokens.weight" in on_disk else "model."


def names(s: ModelSpec, on_disk: set[str], gdn_names) -> NamesTable:
    """The names table of a Qwen hybrid: embedding, norms, head, each layer's mixer and
    feed-forward. `gdn_names(table, spec, file_prefix, model_prefix)` adds a delta-rule layer's
    input projections, the one part the families store differently."""
    p = prefix(on_disk)
    D, V = s.hidden_size, s.vocab_size
    t = NamesTable({}, {}, ignored=lambda name: name.startswith(IGNORED_PREFIXES)
                   or (s.tie_embeddings and name == "lm_head.weight"))
    t.add("embed.weight", p + "embed_tokens.weight", (V, D))
    t.add("norm.weight", p + "norm.weight", (D,), plus_one)
    if not s.tie_embeddings:
        t.add("lm_head.weight", "lm_head.weight", (V, D))
    for layer, mixer in enumerate(s.mixers):
        f, m = f"{p}layers.{layer}.", f"layers.{layer}."
        t.add(m + "mixer_norm.weight", f + "input_layernorm.weight", (D,), plus_one)
        t.add(m + "ffn_norm.weight", f + "post_attention_layernorm.weight", (D,), plus_one)
        if mixer == "gdn":
            _gdn(t, s, f + "linear_attn.", m + "gdn.")
            gdn_names(t, s, f + "linear_attn.", m + "gdn.")
        elif mixer == "attention":
            _attention(t, s, f + "self_attn.", m + "attention.")
        else:
            raise ValueError(f"{s.family} has no {mixer!r} layers")
        if s.ffns[layer] == "moe":
            add_moe(t, s, on_disk, f + "mlp.", m + "moe.")
        elif s.ffns[layer] == "mlp":
            add_mlp(t, D, s.section(MLPSection).intermediate, f + "mlp.", m + "mlp.")
        else:
            raise ValueError(f"unknown feed-forward kind {s.ffns[layer]!r}")
    return t


def _gdn(t: NamesTable, s: ModelSpec, f: str, m: str) -> None:
    g, D = s.section(DeltaNetSection), s.hidden_size
    Hv, dv, C, K = g.value_heads, g.value_dim, g.conv_dim, g.conv_kernel
    t.add(m + "conv.weight", f + "conv1d.weight", (C, 1, K), lambda w: w[:, 0])
    t.add(m + "A_log", f + "A_log", (Hv,))
    t.add(m + "dt_bias", f + "dt_bias", (Hv,))
    t.add(m + "norm.weight", f + "norm.weight", (dv,))
    t.add(m + "out_proj.weight", f + "out_proj.weight", (D, Hv * dv))


def _attention(t: NamesTable, s: ModelSpec, f: str, m: str) -> None:
    """q_proj holds, per head, the query's head_dim rows and then the output gate's."""
    a, D = s.section(AttentionSection), s.hidden_size
    H, Hkv, dh = a.heads, a.kv_heads, a.head_dim
    def half(part: int):
        return lambda w: w.view(H, 2, dh, D)[:, part].reshape(H * dh, D)

    t.add(m + "q_proj.weight", f + "q_proj.weight", (2 * H * dh, D), half(0))
    t.add(m + "gate_proj.weight", f + "q_proj.weight", (2 * H * dh, D), half(1))
    t.add(m + "k_proj.weight", f + "k_proj.weight", (Hkv * dh, D))
    t.add(m + "v_proj.weight", f + "v_proj.weight", (Hkv * dh, D))
    t.add(m + "o_proj.weight", f + "o_proj.weight", (D, H * dh))
    t.add(m + "q_norm.weight", f + "q_norm.weight", (dh,), plus_one)
    t.add(m + "k_norm.weight", f + "k_norm.weight", (dh,), plus_one)


def add_mlp(t: NamesTable, D: int, inner: int, f: str, m: str) -> None:
    t.add(m + "gate_proj.weight", f + "gate_proj.weight", (inner, D))
    t.add(m + "up_proj.weight", f + "up_proj.weight", (inner, D))
    t.add(m + "down_proj.weight", f + "down_proj.weight", (D, inner))


def add_moe(t: NamesTable, s: ModelSpec, on_disk: set[str], f: str, m: str) -> None:
    """Router, experts (one tensor per expert and projection, or fused [E, 2I, D] / [E, D, I]
    tensors), and the shared expert with its sigmoid gate."""
    e, D = s.section(ExpertsSection), s.hidden_size
    E, I = e.experts, e.intermediate
    t.add(m + "router.weight", f + "gate.weight", (E, D))
    if f + "experts.gate_up_proj" in on_disk:
        t.add(m + "experts.gate_up", f + "experts.gate_up_proj", (E, 2 * I, D))
        t.add(m + "experts.down", f + "experts.down_proj", (E, D, I))
    else:
        # Expert e's gate and up rows are rows [0, I) and [I, 2I) of gate_up[e]: each file tensor
        # is read straight into its slice (`part`), or stacked (`build`) where nothing is preallocated.
        gates = {f"{f}experts.{e}.gate_proj.weight": (I, D) for e in range(E)}
        ups = {f"{f}experts.{e}.up_proj.weight": (I, D) for e in range(E)}
        t.add_source(m + "experts.gate_up", gates | ups,
                     lambda *w: torch.cat([torch.stack(w[:E]), torch.stack(w[E:])], dim=1),
                     part=lambda out, i: out[i % E, (i // E) * I:(i // E + 1) * I])
        t.add_source(m + "experts.down", {f"{f}experts.{e}.down_proj.weight": (D, I) for e in range(E)},
                     lambda *w: torch.stack(w), part=lambda out, i: out[i])
    if e.shared_intermediate:
        add_mlp(t, D, e.shared_intermediate, f + "shared_expert.", m + "shared.")
        t.add(m + "shared_gate.weight", f + "shared_expert_gate.weight", (1, D))
