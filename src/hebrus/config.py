"""`HebrusConfig`: the model's shape, validated on construction, plus the named presets.

Field names are the `config.json` keys of the checkpoint format (docs/checkpoint.md); `from_dict`
keeps the keys it knows, so files written by later versions with extra keys still load.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

LAYER_KINDS = ("gdn", "qsa")


@dataclass(slots=True)
class HebrusConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # multi-stream hyper-connection residual
    hc_streams: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    # Gated DeltaNet
    gdn_key_heads: int = 2
    gdn_value_heads: int = 4
    gdn_key_dim: int = 16
    gdn_value_dim: int = 16
    gdn_conv_kernel: int = 4
    # query-selected sparse attention and its indexer
    qsa_heads: int = 4
    qsa_kv_heads: int = 2
    qsa_head_dim: int = 16
    qsa_index_heads: int = 2
    qsa_index_dim: int = 16
    qsa_top_k: int = 4
    rope_theta: float = 10000.0
    # mixture of experts
    moe_experts: int = 4
    moe_top_k: int = 2
    moe_intermediate: int = 32
    moe_shared_intermediate: int = 32
    # per-layer embeddings
    ple_dim: int = 8
    ple_ngram: int = 3
    ple_buckets: tuple[int, ...] = (509, 1021)
    ple_conv_kernel: int = 4
    tie_embeddings: bool = False
    max_context: int = 1024
    init_seed: int = field(default=0)

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types)
        self.ple_buckets = tuple(int(b) for b in self.ple_buckets)
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid hebrus config: " + "; ".join(problems))

    def _problems(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                yield f"{f.name} must be an integer, got {value!r}"
            elif f.type == "int" and value < 1 and f.name != "init_seed":
                yield f"{f.name} must be >= 1, got {value}"
        if len(self.layer_types) != self.num_layers:
            yield f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}"
        for kind in self.layer_types:
            if kind not in LAYER_KINDS:
                yield f"layer type {kind!r} is not one of {LAYER_KINDS}"
        if self.gdn_value_heads % self.gdn_key_heads:
            yield "gdn_value_heads must be a multiple of gdn_key_heads"
        if self.qsa_heads % self.qsa_kv_heads:
            yield "qsa_heads must be a multiple of qsa_kv_heads"
        for name in ("qsa_head_dim", "qsa_index_dim"):
            if getattr(self, name) % 2:
                yield f"{name} must be even (rotary embedding)"
        if self.moe_top_k > self.moe_experts:
            yield f"moe_top_k={self.moe_top_k} exceeds moe_experts={self.moe_experts}"
        if self.ple_ngram < 2 or len(self.ple_buckets) != self.ple_ngram - 1:
            yield "ple_buckets needs one bucket count per n-gram order 2..ple_ngram (ple_ngram >= 2)"
        if any(b < 1 for b in self.ple_buckets):
            yield "every ple bucket count must be >= 1"

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    @property
    def ple_width(self) -> int:
        """L·P: one P-wide slice per layer."""
        return self.num_layers * self.ple_dim

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_streams) * self.hc_streams

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": "hebrus"}
        for key, value in dataclasses.asdict(self).items():
            data[key] = list(value) if isinstance(value, tuple) else value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HebrusConfig":
        model_type = data.get("model_type", "hebrus")
        if model_type != "hebrus":
            raise ValueError(f"config model_type is {model_type!r}; this loader reads 'hebrus'")
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ValueError(f"config is missing required keys: {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})

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
        raise ValueError(f"unknown preset {name!r}; presets are: {', '.join(PRESETS)}")
    return PRESETS[name]()
