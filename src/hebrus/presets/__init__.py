"""Trained models shipped with the package, by name: each is a checkpoint folder beside this file
(the format of docs/checkpoint.md), loaded like any other. The random presets (`tiny`, `small`)
are configs in `hebrus.models.hebrus`; `names()` lists both kinds.

- `shakespeare`: the Hebrus model of `recipes/shakespeare` (9.39M parameters, bytes in and out,
  stored in bf16), trained on Shakespeare's plays and poems.
"""
from __future__ import annotations

from pathlib import Path

from hebrus.models.hebrus import PRESETS

HERE = Path(__file__).parent
TRAINED = {"shakespeare": HERE / "shakespeare"}


def names() -> list[str]:
    """Every preset name: the trained ones first."""
    return [*TRAINED, *PRESETS]
