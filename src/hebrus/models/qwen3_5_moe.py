"""Qwen3.5-MoE: the Qwen3.5 layers with routed experts (always renormalised) and a gated shared
expert in every layer."""
from __future__ import annotations

from typing import Any

from hebrus.layers.spec import ModelSpec
from hebrus.models import qwen
from hebrus.models.qwen3_5 import gdn_names
from hebrus.weights.table import NamesTable

NAME = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# how its models write tool calls (`hebrus.text.tools`)
TOOL_CALLS = "qwen3_xml"


def config(data: Any) -> qwen.QwenConfig:
    c = qwen.QwenConfig.from_dict(data, required=qwen.MOE_KEYS)
    qwen.require_experts(c)
    return c


def spec(c: qwen.QwenConfig) -> ModelSpec:
    return qwen.spec(c, NAME, ffns=("moe",) * c.num_hidden_layers, moe_normalize=True)


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    return qwen.names(s, on_disk, gdn_names)
