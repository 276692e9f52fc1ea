"""Model families: one short module each, turning a checkpoint's `config.json` into a checked
family config, a `ModelSpec` for the shared layers, and a names table for its tensors.

A family module provides `MODEL_TYPES`, `config(data) -> config`, `spec(config) -> ModelSpec`
and `names(spec, on_disk) -> NamesTable`, and declares `TOOL_CALLS`: how its models write tool calls
(`hebrus.text.tools.FORMATS`), or None.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from hebrus.errors import InvalidInput
from hebrus.models import deepseek_v4, hebrus, kimi_linear, qwen3_5, qwen3_5_moe, qwen3_next
from hebrus.show import shown

FAMILIES: tuple[ModuleType, ...] = (hebrus, qwen3_5, qwen3_5_moe, qwen3_next, kimi_linear, deepseek_v4)
_BY_TYPE = {model_type: family for family in FAMILIES for model_type in family.MODEL_TYPES}


def family_of(data: Any) -> ModuleType:
    """The family that reads a parsed `config.json` (no model_type: a Hebrus config)."""
    if not isinstance(data, dict):
        raise InvalidInput(f"a config is a JSON object, got {shown(data)}")
    model_type = data.get("model_type", "hebrus")
    if not isinstance(model_type, str) or model_type not in _BY_TYPE:
        raise InvalidInput(f"model_type {shown(model_type)} is not supported; supported: "
                           f"{', '.join(sorted(_BY_TYPE))}")
    return _BY_TYPE[model_type]


def supported() -> list[str]:
    return [family.NAME for family in FAMILIES]


def tool_calls(family: str) -> str | None:
    """How models of `family` (its NAME) write tool calls (`hebrus.text.tools.FORMATS`), or None."""
    return next((getattr(f, "TOOL_CALLS", None) for f in FAMILIES if f.NAME == family), None)
