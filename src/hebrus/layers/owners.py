"""The owner table of a session, generated from the model's spec (one source of truth)."""
from __future__ import annotations

import torch

from hebrus.layers.spec import ModelSpec
from hebrus.ops.quant import CACHE_DTYPES
from hebrus.state.owners import APPENDED, OwnerSpec


def owner_specs(c: ModelSpec, dtype: torch.dtype, state_dtype: torch.dtype) -> list[OwnerSpec]:
    n, D, V = c.hc_streams, c.hidden_size, c.vocab_size
    specs = [
        OwnerSpec("frontier", (), torch.int64),
        OwnerSpec("residual", (n, D), dtype),
        OwnerSpec("logits", (V,), dtype),
    ]
    if c.ple_dim:
        specs += [
            OwnerSpec("ple.history", (c.ple_ngram - 1,), torch.int64, fill=V, limit=V + 1),   # PAD = V
            OwnerSpec("ple.conv", (c.ple_conv_kernel - 1, c.ple_width), dtype),
        ]
    for layer, kind in enumerate(c.mixers):
        p = f"layers.{layer}."
        if kind == "gdn":
            specs += [
                OwnerSpec(p + "gdn.conv", (c.gdn_conv_dim, c.gdn_conv_kernel - 1), dtype),
                OwnerSpec(p + "gdn.recurrent", (c.gdn_value_heads, c.gdn_key_dim, c.gdn_value_dim), state_dtype),
            ]
        elif kind in ("qsa", "attention"):
            kv, rows = (c.attn_kv_heads, c.attn_head_dim), dtype if c.kv_cache is None else CACHE_DTYPES[c.kv_cache]
            specs += [OwnerSpec(f"{p}{kind}.k", kv, rows, APPENDED), OwnerSpec(f"{p}{kind}.v", kv, rows, APPENDED)]
            if kind == "qsa":
                specs.append(OwnerSpec(p + "qsa.index", (c.index_dim,), rows, APPENDED))
            if c.kv_cache is not None:          # a float32 scale per row (per head of a K/V row)
                specs += [OwnerSpec(f"{p}{kind}.{part}_scale", shape, torch.float32, APPENDED) for part, shape in
                          (("k", kv[:1]), ("v", kv[:1])) + ((("index", (1,)),) if kind == "qsa" else ())]
        else:
            raise ValueError(f"unknown mixer {kind!r}")
    if c.moe_layers:
        specs.append(OwnerSpec("routes", (len(c.moe_layers), c.moe_top_k), torch.int32, APPENDED,
                               limit=c.moe_experts))
    return specs
