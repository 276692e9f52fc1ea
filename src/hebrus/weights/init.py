"""Deterministic, seeded initialisation that makes every component do something.

Projections are N(0, 1/fan_in); RMSNorm weights are 1; gates and decays land in their
unsaturated range; hash constants are random odd 62-bit integers, so the int64 products wrap.
"""
from __future__ import annotations

import math

import torch

from hebrus.config import HebrusConfig
from hebrus.layers.spec import ModelSpec
from hebrus.weights.layout import parameter_shapes


_CPU32 = {"dtype": torch.float32, "device": "cpu"}      # whatever torch's defaults are set to


def init_parameters(c: HebrusConfig | ModelSpec, seed: int | None = None) -> dict[str, torch.Tensor]:
    """float32 (int64 for hash constants) tensors on the CPU, keyed by the model's own names.
    A Hebrus config seeds from its `init_seed`; a bare spec from `seed` (default 0)."""
    if isinstance(c, HebrusConfig):
        seed, c = c.init_seed if seed is None else seed, c.spec()
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    return {name: _draw(name, shape, gen) for name, shape in parameter_shapes(c).items()}


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, **_CPU32) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen, **_CPU32)

    leaf = name.rsplit(".", 1)[-1]
    if name == "ple.hash_constants":
        odd = torch.randint(0, 2**61, shape, generator=gen, dtype=torch.int64, device="cpu") * 2 + 1
        keep = torch.arange(shape[1], device="cpu")[None, :] < torch.arange(2, shape[0] + 2, device="cpu")[:, None]
        return torch.where(keep, odd, 0)
    if leaf == "A_log":
        return uniform(1.0, 8.0).log()
    if leaf == "dt_bias":
        return uniform(0.01, 0.1).expm1().log()                 # softplus⁻¹ of [0.01, 0.1]
    if leaf == "scale":
        return uniform(0.5, 1.5)
    if leaf == "base":
        return normal(0.5)
    if leaf == "bias":
        return normal(0.1)
    if name.endswith("norm.weight"):
        return torch.ones(shape, **_CPU32)
    if name in ("embed.weight", "ple.unigram.weight") or name.startswith("ple.ngram."):
        return normal(1.0)
    if name == "ple.conv.weight" or name.endswith("gdn.conv.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    return normal(1.0 / math.sqrt(shape[-1]))                   # projections: fan_in is the last dim
