"""The owner table of a session, generated from the config (one source of truth)."""
from __future__ import annotations

import torch

from hebrus.config import HebrusConfig
from hebrus.state.owners import APPENDED, OwnerSpec


def owner_specs(c: HebrusConfig, dtype: torch.dtype, state_dtype: torch.dtype) -> list[OwnerSpec]:
    n, D, V = c.hc_streams, c.hidden_size, c.vocab_size
    specs = [
        OwnerSpec("frontier", (), torch.int64),
        OwnerSpec("residual", (n, D), dtype),
        OwnerSpec("logits", (V,), dtype),
        OwnerSpec("ple.history", (c.ple_ngram - 1,), torch.int64, fill=V),   # PAD = V
        OwnerSpec("ple.conv", (c.ple_conv_kernel - 1, c.ple_width), dtype),
    ]
    for layer, kind in enumerate(c.layer_types):
        p = f"layers.{layer}."
        if kind == "gdn":
            specs += [
                OwnerSpec(p + "gdn.conv", (c.gdn_conv_dim, c.gdn_conv_kernel - 1), dtype),
                OwnerSpec(p + "gdn.recurrent", (c.gdn_value_heads, c.gdn_key_dim, c.gdn_value_dim), state_dtype),
            ]
        else:
            specs += [
                OwnerSpec(p + "qsa.k", (c.qsa_kv_heads, c.qsa_head_dim), dtype, APPENDED),
                OwnerSpec(p + "qsa.v", (c.qsa_kv_heads, c.qsa_head_dim), dtype, APPENDED),
                OwnerSpec(p + "qsa.index", (c.qsa_index_dim,), dtype, APPENDED),
            ]
    specs.append(OwnerSpec("routes", (c.num_layers, c.moe_top_k), torch.int32, APPENDED))
    return specs
