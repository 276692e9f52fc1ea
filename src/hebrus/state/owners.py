"""An owner is one named piece of persistent per-session state: name, shape, dtype, kind.

`banked` owners have a copy in each of the two banks; `appended` owners are row logs whose rows
below the frontier are public. For appended owners `shape` is the shape of one row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BANKED = "banked"
APPENDED = "appended"


@dataclass(frozen=True, slots=True)
class OwnerSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = BANKED
    fill: float = 0.0          # value of a fresh session's bank
    limit: int | None = None   # an integer owner's values lie in [0, limit)

    @property
    def nbytes(self) -> int:
        """Bytes of one bank's copy (banked) or of one row (appended)."""
        return math.prod(self.shape) * self.dtype.itemsize


def bank_bytes(specs: list[OwnerSpec]) -> int:
    """Bytes of both banks of the banked owners in `specs`."""
    return 2 * sum(s.nbytes for s in specs if s.kind == BANKED)
