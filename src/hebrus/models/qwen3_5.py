"""Qwen3.5 (dense): Gated DeltaNet and gated attention layers, a dense MLP in every layer.

Text-only checkpoints (`qwen3_5_text`) keep the text model under `model.`; the multimodal ones
(`qwen3_5`) nest its config in `text_config` and its tensors under `model.language_model.`, next
to a vision tower this runtime ignores.
"""
from __future__ import annotations

from typing import Any

from hebrus.layers.gdn import DeltaNetSection
from hebrus.layers.spec import ModelSpec
from hebrus.models import qwen
from hebrus.weights.table import NamesTable

NAME = "qwen3_5"
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# how its models write tool calls (`hebrus.text.tools`)
TOOL_CALLS = "qwen3_xml"


def config(data: Any) -> qwen.QwenConfig:
    return qwen.QwenConfig.from_dict(data, required=("intermediate_size",))


def spec(c: qwen.QwenConfig) -> ModelSpec:
    return qwen.spec(c, NAME, ffns=("mlp",) * c.num_hidden_layers)


def gdn_names(t: NamesTable, s: ModelSpec, f: str, m: str) -> None:
    """Separate projections: in_proj_qkv (all query heads, all key heads, all value heads), z, b, a."""
    g, D = s.section(DeltaNetSection), s.hidden_size
    Hv, dv = g.value_heads, g.value_dim
    t.add(m + "in_proj_qkv.weight", f + "in_proj_qkv.weight", (g.conv_dim, D))
    t.add(m + "in_proj_z.weight", f + "in_proj_z.weight", (Hv * dv, D))
    t.add(m + "in_proj_b.weight", f + "in_proj_b.weight", (Hv, D))
    t.add(m + "in_proj_a.weight", f + "in_proj_a.weight", (Hv, D))


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    return qwen.names(s, on_disk, gdn_names)
