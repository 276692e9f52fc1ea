"""Qwen3-Next: the Qwen3.5 layers, with the delta rule's projections stored interleaved per key
head (`in_proj_qkvz`, `in_proj_ba`), and routed experts (renormalised if `norm_topk_prob`) in the
layers that `decoder_sparse_step` and `mlp_only_layers` pick; a dense MLP in the others."""
from __future__ import annotations

from typing import Any

import torch

from hebrus.layers.gdn import DeltaNetSection
from hebrus.layers.spec import ModelSpec
from hebrus.models import qwen
from hebrus.weights.table import NamesTable

NAME = "qwen3_next"
MODEL_TYPES = ("qwen3_next",)
# how its models write tool calls (`hebrus.text.tools`)
TOOL_CALLS = "hermes"


def config(data: Any) -> qwen.QwenConfig:
    return qwen.QwenConfig.from_dict(data, required=("intermediate_size",) + qwen.MOE_KEYS)


def spec(c: qwen.QwenConfig) -> ModelSpec:
    def routed(layer: int) -> bool:
        return (layer not in c.mlp_only_layers and c.num_experts > 0
                and (layer + 1) % c.decoder_sparse_step == 0)

    if any(routed(layer) for layer in range(c.num_hidden_layers)):
        qwen.require_experts(c)
    ffns = tuple("moe" if routed(layer) else "mlp" for layer in range(c.num_hidden_layers))
    return qwen.spec(c, NAME, ffns=ffns, moe_normalize=c.norm_topk_prob)


def gdn_names(t: NamesTable, s: ModelSpec, f: str, m: str) -> None:
    """in_proj_qkvz holds, per key head: its query (dk rows), key (dk), its g value heads (g·dv)
    and their z (g·dv); in_proj_ba per key head: g rows of b, then g of a. The model's layout is
    every query head, every key head, every value head (the conv's channel order), then z."""
    d, D = s.section(DeltaNetSection), s.hidden_size
    Hk, dk, Hv, dv = d.key_heads, d.key_dim, d.value_heads, d.value_dim
    g = Hv // Hk
    per_head = 2 * dk + 2 * g * dv

    def qkv(w):
        q, k, v, _ = w.view(Hk, per_head, D).split([dk, dk, g * dv, g * dv], dim=1)
        return torch.cat([part.reshape(-1, D) for part in (q, k, v)])

    def z(w):
        return w.view(Hk, per_head, D)[:, 2 * dk + g * dv:].reshape(Hv * dv, D)

    def ba(half: int):
        return lambda w: w.view(Hk, 2 * g, D)[:, half * g:(half + 1) * g].reshape(Hv, D)

    t.add(m + "in_proj_qkv.weight", f + "in_proj_qkvz.weight", (Hk * per_head, D), qkv)
    t.add(m + "in_proj_z.weight", f + "in_proj_qkvz.weight", (Hk * per_head, D), z)
    t.add(m + "in_proj_b.weight", f + "in_proj_ba.weight", (2 * Hv, D), ba(0))
    t.add(m + "in_proj_a.weight", f + "in_proj_ba.weight", (2 * Hv, D), ba(1))


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    return qwen.names(s, on_disk, gdn_names)
