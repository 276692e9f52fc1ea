"""`ModelSpec`: what the shared layers are built from.

Every family (`hebrus.models`) translates its own config into one of these; the layers, the
owner table and the tensor-shape table read only this. A field that a family does not use takes
its "off" value (no PLE: `ple_dim=0`; no shared expert: `moe_shared_intermediate=0`).

Variants the families differ in:
- residual: "hyper" (n hyper-connection streams, Sinkhorn mixing) or "plain" (x + f(norm(x)),
  exactly; one stream);
- mixers, per layer: "gdn" (Gated DeltaNet), "qsa" (gated attention over the rows an indexer
  selects) or "attention" (gated attention over every row: no indexer);
- ffns, per layer: "moe" (routed experts, optionally a gated shared expert) or "mlp";
- rotary_dim: attention rotates the first `rotary_dim` features of each head (partial rotary),
  with tables built over those features only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

from hebrus.errors import InvalidInput

RESIDUALS = ("hyper", "plain")
MIXERS = ("gdn", "qsa", "attention")
FFNS = ("moe", "mlp")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    mixers: tuple[str, ...]
    ffns: tuple[str, ...]
    max_context: int
    rms_norm_eps: float
    tie_embeddings: bool = False
    # residual
    residual: str = "hyper"
    hc_streams: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Gated DeltaNet
    gdn_key_heads: int = 1
    gdn_value_heads: int = 1
    gdn_key_dim: int = 1
    gdn_value_dim: int = 1
    gdn_conv_kernel: int = 1
    # attention (gated; qsa adds the indexer)
    attn_heads: int = 1
    attn_kv_heads: int = 1
    attn_head_dim: int = 2
    rotary_dim: int = 2
    rope_theta: float = 10000.0
    index_heads: int = 1
    index_dim: int = 2
    top_k: int = 1
    # feed-forward
    moe_experts: int = 1
    moe_top_k: int = 1
    moe_intermediate: int = 1
    moe_shared_intermediate: int = 0        # 0: no shared expert
    moe_normalize: bool = True              # renormalise the chosen experts' probabilities
    mlp_intermediate: int = 1
    # per-layer embeddings (0: none)
    ple_dim: int = 0
    ple_ngram: int = 2
    ple_buckets: tuple[int, ...] = (1,)
    ple_conv_kernel: int = 1
    # weights: None, or a weights.quant.Quantization (which projections are stored quantized, how)
    quantization: object = None
    # K/V rows and index keys: None (the model dtype), or "int8" / "fp8" codes with a scale per row
    kv_cache: str | None = None

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise InvalidInput(f"invalid {self.family} model: " + "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if len(self.mixers) != len(self.ffns):
            yield f"{len(self.mixers)} mixers for {len(self.ffns)} feed-forward layers"
        # An unknown kind is an error here, never the last branch of an if further down.
        for kind in self.mixers:
            if kind not in MIXERS:
                yield f"unknown mixer {kind!r}; mixers are {', '.join(MIXERS)}"
        for kind in self.ffns:
            if kind not in FFNS:
                yield f"unknown feed-forward kind {kind!r}; kinds are {', '.join(FFNS)}"
        if self.residual not in RESIDUALS:
            yield f"unknown residual {self.residual!r}; residuals are {', '.join(RESIDUALS)}"
        if self.residual == "plain" and self.hc_streams != 1:
            yield "a plain residual has one stream"
        if "gdn" in self.mixers and self.gdn_value_heads % self.gdn_key_heads:
            yield (f"delta-rule value heads ({self.gdn_value_heads}) must be a multiple of its key heads "
                   f"({self.gdn_key_heads})")
        if self.has_attention:
            if self.attn_heads % self.attn_kv_heads:
                yield f"attention heads ({self.attn_heads}) must be a multiple of its K/V heads ({self.attn_kv_heads})"
            if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.attn_head_dim:
                yield (f"the rotary width ({self.rotary_dim}) must be even and at most the head dim "
                       f"({self.attn_head_dim})")
        if "qsa" in self.mixers:
            if self.index_dim % 2:
                yield f"the index dim ({self.index_dim}) must be even (rotary embedding)"
            if self.top_k > self.max_context:
                yield f"top_k={self.top_k} exceeds max_context={self.max_context}"
        if "moe" in self.ffns and self.moe_top_k > self.moe_experts:
            yield f"experts per token ({self.moe_top_k}) exceeds the experts ({self.moe_experts})"
        if self.ple_dim and len(self.ple_buckets) != self.ple_ngram - 1:
            yield f"{len(self.ple_buckets)} PLE bucket counts for n-gram orders 2..{self.ple_ngram}"

    # ---- derived ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def has_attention(self) -> bool:
        return any(kind in ("qsa", "attention") for kind in self.mixers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward is routed, in order (their routes are state)."""
        return tuple(i for i, kind in enumerate(self.ffns) if kind == "moe")

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

    def fields_in_use(self) -> list[tuple[str, object]]:
        """(name, value) of the fields the model's layers read: no hyper-connection fields for a
        plain residual, no PLE fields without PLE, no indexer or expert fields without them."""
        unused = set()
        if self.residual == "plain":
            unused |= {"hc_streams", "hc_sinkhorn_iters", "hc_eps"}
        if not self.ple_dim:
            unused |= {"ple_ngram", "ple_buckets", "ple_conv_kernel"}
        if "qsa" not in self.mixers:
            unused |= {"index_heads", "index_dim", "top_k"}
        if "gdn" not in self.mixers:
            unused |= {f.name for f in dataclasses.fields(self) if f.name.startswith("gdn_")}
        if not self.has_attention:
            unused |= {"attn_heads", "attn_kv_heads", "attn_head_dim", "rotary_dim", "rope_theta"}
        if "moe" not in self.ffns:
            unused |= {f.name for f in dataclasses.fields(self) if f.name.startswith("moe_")}
        if "mlp" not in self.ffns:
            unused.add("mlp_intermediate")
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in unused and f.name != "family"]

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)
