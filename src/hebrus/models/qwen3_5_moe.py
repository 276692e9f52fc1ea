"""Qwen3.5-MoE: the Qwen3.5 layers with routed experts (always renormalised) and a gated shared
expert in every layer."""
from __future__ import annotations

from typing import Any

from hebrus.layers.spec import ModelSpec
from hebrus.models import qwen
from hebrus.models.qwen3_5 import gdn_names
from hebrus.models.table import NamesTable

NAME = "qwen3_5_moe"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def config(data: Any) -> qwen.QwenConfig:
    c = qwen.QwenConfig.from_dict(data)
    qwen.require_experts(c)
    return c


def spec(c: qwen.QwenConfig) -> ModelSpec:
    return qwen.spec(c, NAME, ffns=("moe",) * c.num_hidden_layers, moe_normalize=True)


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    t = qwen.base_table(s, on_disk, gdn_names)
    p = qwen.prefix(on_disk)
    for layer in range(s.num_layers):
        qwen.add_moe(t, s, on_disk, f"{p}layers.{layer}.mlp.", f"layers.{layer}.moe.")
    return t
