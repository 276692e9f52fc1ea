"""A model laid over tensor-parallel ranks: each rank's spec and its part of every weight.

Each kind says how its layers lie (`Kind.shards`): split (heads or inner width divided, the
output a partial sum that the frame adds up across ranks, `Kernels.reduce`), whole (held and
computed by every rank alike) or not yet. The frame's own weights lie so: the embedding and an
untied head split by vocabulary rows (every rank the same number, the last padded with zero
rows, so that the logits' parts gather into one row of equal pieces, `Kernels.gather`); the
residual's maps and the norms whole. Every rank's owners follow from its spec: a split kind's
state is that rank's heads only; the residual, the logits and the routes are whole on every
rank, and equal there.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hebrus.errors import InvalidInput
from hebrus.layers.kind import KINDS
from hebrus.layers.layout import layout
from hebrus.layers.spec import ModelSpec

VOCABULARY = ("embed.weight", "lm_head.weight")         # the frame's weights split by vocabulary rows


def vocabulary_rows(vocab: int, world: int) -> int:
    """The vocabulary rows each rank holds (the last rank's past the vocabulary are zeros)."""
    return -(-vocab // world)


def shard_spec(s: ModelSpec, world: int) -> ModelSpec:
    """The spec each of `world` ranks builds its layers from: a splitting kind's section divided.
    InvalidInput naming every kind that cannot shard yet, or a section that does not divide."""
    kinds = s.kinds()
    refused = sorted({kind.name for kind in kinds if kind.shards == "no"})
    if refused:
        raise InvalidInput(f"tensor parallelism: the {s.family} model has layers that cannot be split over "
                           f"ranks yet ({', '.join(refused)}); kinds that can: "
                           f"{', '.join(sorted(n for n, k in KINDS.items() if k.shards != 'no'))}")
    if s.quantization is not None:
        raise InvalidInput(f"a checkpoint stored quantized ({s.quantization.name}) does not split over ranks yet: load "
                           f"its float checkpoint with quantize=, and each rank quantizes its part")
    sections = list(s.sections)
    for kind in kinds:
        if kind.shards != "split" or kind.section is None:
            continue
        at = next(i for i, section in enumerate(sections) if type(section) is kind.section)
        if sections[at] is not s.section(kind.section):         # divided already (a kind sharing it)
            continue
        try:
            sections[at] = kind.shard_section(sections[at], world)
        except ValueError as exc:
            raise InvalidInput(f"tensor parallelism over {world} ranks: {kind.name} layers: {exc}") from None
    return dataclasses.replace(s, sections=tuple(sections))


def weight_parts(s: ModelSpec, rank: int, world: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Rank `rank`'s part of one weight of a model of spec `s` (whole), by its name: a split
    weight's a tensor of its own (`Kind.shard_weight`'s `spans` copy it out), a whole one the
    same. A load cuts each weight as it is read (`weights.checkpoint.load`'s `split`)."""
    entries = {w.name: w for w in layout(s)}

    def part(name: str, weight: torch.Tensor) -> torch.Tensor:
        w = entries.get(name)
        if w is not None and w.kind is not None and w.kind.shards == "split":
            return w.kind.shard_weight(s, w.leaf, weight, rank, world)
        if w is not None and w.kind is None and name in VOCABULARY:
            return vocabulary_part(weight, rank, world)
        return weight
    return part


def shard_params(s: ModelSpec, params: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of every weight of a model of spec `s` (whole, in memory)."""
    part = weight_parts(s, rank, world)
    return {w.name: part(w.name, params[w.name]) for w in layout(s)}


def vocabulary_part(table: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows rank·n .. (rank+1)·n of a [V, D] table, n = ceil(V / world), zeros past V: a tensor
    of its own."""
    n = vocabulary_rows(table.shape[0], world)
    part = table[rank * n:(rank + 1) * n]
    return torch.cat([part, part.new_zeros((n - part.shape[0], *table.shape[1:]))])
