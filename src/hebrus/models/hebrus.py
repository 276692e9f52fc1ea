"""The Hebrus family: its config is `HebrusConfig` (validated on construction), its presets,
and its file names are the model's own names.

Field names are the `config.json` keys of the checkpoint format (docs/checkpoint.md); `from_dict`
keeps the keys it knows, so files written by later versions with extra keys still load. Every
field has a type and an allowed range (`bounded`); a config outside them raises `InvalidInput`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from hebrus.errors import InvalidInput
from hebrus.layers.attention import AttentionSection
from hebrus.layers.gdn import DeltaNetSection
from hebrus.layers.layout import init_parameters
from hebrus.layers.moe import ExpertsSection
from hebrus.layers.ple import PLESection
from hebrus.layers.spec import ModelSpec
from hebrus.models.layout import parameter_shapes, stored_dtypes
from hebrus.show import shown
from hebrus.weights.limits import MAX_HEADS, MAX_KERNEL, MAX_ROWS, MAX_WIDTH, bounded, field_problems, from_json, json_kind
from hebrus.weights.table import NamesTable

NAME = "hebrus"
MODEL_TYPES = ("hebrus",)
TOOL_CALLS = None                   # its models write no tool calls (`hebrus.text.tools`)
LAYER_KINDS = ("gdn", "qsa")


@dataclass(slots=True)
class HebrusConfig:
    vocab_size: int = bounded(1, MAX_ROWS)
    hidden_size: int = bounded(1, MAX_WIDTH)
    num_layers: int = bounded(1, 1024)
    layer_types: tuple[str, ...] = bounded(choices=LAYER_KINDS)
    # multi-stream hyper-connection residual
    hc_streams: int = bounded(1, 16, 4)
    hc_sinkhorn_iters: int = bounded(1, 200, 20)            # runs per sublayer per token
    hc_eps: float = bounded(0, 1, 1e-6)
    rms_norm_eps: float = bounded(0, 1, 1e-6, open_low=True)
    # Gated DeltaNet
    gdn_key_heads: int = bounded(1, MAX_HEADS, 2)
    gdn_value_heads: int = bounded(1, MAX_HEADS, 4)
    gdn_key_dim: int = bounded(1, MAX_HEADS, 16)
    gdn_value_dim: int = bounded(1, MAX_HEADS, 16)
    gdn_conv_kernel: int = bounded(1, MAX_KERNEL, 4)
    # query-selected sparse attention and its indexer
    qsa_heads: int = bounded(1, MAX_HEADS, 4)
    qsa_kv_heads: int = bounded(1, MAX_HEADS, 2)
    qsa_head_dim: int = bounded(2, MAX_HEADS, 16)
    qsa_index_heads: int = bounded(1, MAX_HEADS, 2)
    qsa_index_dim: int = bounded(2, MAX_HEADS, 16)
    qsa_top_k: int = bounded(1, 2**20, 4)
    rope_theta: float = bounded(0, math.inf, 10000.0, open_low=True)
    # mixture of experts
    moe_experts: int = bounded(1, 4096, 4)
    moe_top_k: int = bounded(1, 4096, 2)
    moe_intermediate: int = bounded(1, 2**18, 32)
    moe_shared_intermediate: int = bounded(1, 2**18, 32)
    # per-layer embeddings
    ple_dim: int = bounded(1, MAX_WIDTH, 8)
    ple_ngram: int = bounded(2, 16, 3)
    ple_buckets: tuple[int, ...] = bounded(1, MAX_ROWS, (509, 1021))
    ple_conv_kernel: int = bounded(1, MAX_KERNEL, 4)
    tie_embeddings: bool = bounded(default=False)
    max_context: int = bounded(1, 2**20, 1024)              # rotary tables hold every position
    init_seed: int = bounded(0, 2**64 - 1, 0)               # torch.Generator's seed range

    def __post_init__(self) -> None:
        problems = field_problems(self)
        if not problems:
            problems = list(self._shape_problems())
        if problems:
            more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
            raise InvalidInput("invalid hebrus config: " + "; ".join(problems[:8]) + more)

    def _shape_problems(self) -> Iterator[str]:
        if len(self.layer_types) != self.num_layers:
            yield f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}"
        if self.gdn_value_heads % self.gdn_key_heads:
            yield "gdn_value_heads must be a multiple of gdn_key_heads"
        if self.qsa_heads % self.qsa_kv_heads:
            yield "qsa_heads must be a multiple of qsa_kv_heads"
        for name in ("qsa_head_dim", "qsa_index_dim"):
            if getattr(self, name) % 2:
                yield f"{name} must be even (rotary embedding)"
        if self.moe_top_k > self.moe_experts:
            yield f"moe_top_k={self.moe_top_k} exceeds moe_experts={self.moe_experts}"
        if len(self.ple_buckets) != self.ple_ngram - 1:
            yield (f"ple_buckets has {len(self.ple_buckets)} entries; it needs one bucket count per "
                   f"n-gram order 2..ple_ngram, {self.ple_ngram - 1} for ple_ngram={self.ple_ngram}")
        if self.qsa_top_k > self.max_context:
            yield f"qsa_top_k={self.qsa_top_k} exceeds max_context={self.max_context}"

    def spec(self) -> ModelSpec:
        """The Hebrus model in the shared layers' terms: hyper-connection residual,
        gdn/qsa mixers, a routed ffn with a shared expert and a PLE branch in every layer."""
        sections = (
            DeltaNetSection(self.gdn_key_heads, self.gdn_value_heads, self.gdn_key_dim, self.gdn_value_dim,
                            self.gdn_conv_kernel),
            AttentionSection(self.qsa_heads, self.qsa_kv_heads, self.qsa_head_dim, rotary_dim=self.qsa_head_dim,
                             rope_theta=self.rope_theta, index_heads=self.qsa_index_heads,
                             index_dim=self.qsa_index_dim, top_k=self.qsa_top_k),
            ExpertsSection(self.moe_experts, self.moe_top_k, self.moe_intermediate, self.moe_shared_intermediate),
            PLESection(self.ple_dim, self.ple_ngram, self.ple_buckets, self.ple_conv_kernel),
        )
        return ModelSpec(
            family="hebrus", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            mixers=self.layer_types, ffns=("moe",) * self.num_layers, max_context=self.max_context,
            rms_norm_eps=self.rms_norm_eps, tie_embeddings=self.tie_embeddings,
            residual="hyper", hc_streams=self.hc_streams, hc_sinkhorn_iters=self.hc_sinkhorn_iters,
            hc_eps=self.hc_eps, branches=("ple",), sections=sections,
        )

    def init_parameters(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        """Random weights (`layers.layout.init_parameters`), seeded by `init_seed` unless `seed`."""
        return init_parameters(self.spec(), self.init_seed if seed is None else seed)

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": "hebrus"}
        for key, value in dataclasses.asdict(self).items():
            data[key] = list(value) if isinstance(value, tuple) else value
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "HebrusConfig":
        """A config from parsed JSON: an object with model_type "hebrus" (or none) and every
        required key; unknown keys are ignored. Anything else raises InvalidInput."""
        if not isinstance(data, dict):
            raise InvalidInput(f"a hebrus config is a JSON object, got {json_kind(data)}")
        model_type = data.get("model_type", "hebrus")
        if model_type != "hebrus":
            raise InvalidInput(f"model_type is {shown(model_type)}; this loader reads 'hebrus'")
        return from_json(cls, data)

    def replace(self, **changes: Any) -> "HebrusConfig":
        return dataclasses.replace(self, **changes)


def _tiny() -> HebrusConfig:
    return HebrusConfig(
        vocab_size=256, hidden_size=64, num_layers=4, layer_types=("gdn", "qsa", "gdn", "qsa"),
        max_context=1024,
    )


def _small() -> HebrusConfig:
    return HebrusConfig(
        vocab_size=256, hidden_size=512, num_layers=8,
        layer_types=("gdn", "gdn", "qsa", "gdn", "gdn", "qsa", "gdn", "qsa"),
        gdn_key_heads=4, gdn_value_heads=8, gdn_key_dim=64, gdn_value_dim=64,
        qsa_heads=8, qsa_kv_heads=2, qsa_head_dim=64, qsa_index_heads=4, qsa_index_dim=64,
        qsa_top_k=64, moe_experts=8, moe_top_k=2, moe_intermediate=512,
        moe_shared_intermediate=768, ple_dim=64, ple_buckets=(4093, 8191), max_context=4096,
    )


PRESETS = {"tiny": _tiny, "small": _small}


def preset(name: str) -> HebrusConfig:
    if name not in PRESETS:
        raise InvalidInput(f"unknown preset {name!r}; presets are: {', '.join(PRESETS)}")
    return PRESETS[name]()


def config(data: Any) -> HebrusConfig:
    return HebrusConfig.from_dict(data)


def spec(c: HebrusConfig) -> ModelSpec:
    return c.spec()


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    return NamesTable.identity(parameter_shapes(s), dtypes=stored_dtypes)
