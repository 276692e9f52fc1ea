"""The Hebrus family: its config is `HebrusConfig`, its file names are the model's own names."""
from __future__ import annotations

from typing import Any

from hebrus.config import HebrusConfig
from hebrus.layers.spec import ModelSpec
from hebrus.models.table import NamesTable
from hebrus.weights.layout import parameter_shapes, stored_dtypes

NAME = "hebrus"
MODEL_TYPES = ("hebrus",)


def config(data: Any) -> HebrusConfig:
    return HebrusConfig.from_dict(data)


def spec(c: HebrusConfig) -> ModelSpec:
    return c.spec()


def names(s: ModelSpec, on_disk: set[str]) -> NamesTable:
    return NamesTable.identity(parameter_shapes(s), dtypes=stored_dtypes)
