"""The dense MLP, an ffn kind: down(silu(gate(h)) ⊙ up(h))."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from hebrus.layers.kernels import unfused
from hebrus.layers.kind import Cost, Kind, divided, own, spans
from hebrus.ops.moe import silu_mul
from hebrus.ops.quant import Products, linear

PROJECTIONS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# (x, [gate; up] side by side) -> silu(x Gᵀ) ⊙ x Uᵀ in one op, or None where it does not take them
SILU_GATED = "mlp.silu_gated"


@dataclass(frozen=True, slots=True)
class MLPSection:
    key: ClassVar[str] = "mlp"
    intermediate: int

    def problems(self, s):
        return ()


def swiglu(h: torch.Tensor, gate_up: Products, down: torch.Tensor, fused=unfused, product=linear,
           limit: float | None = None, gated=None) -> torch.Tensor:
    """`gate_up`: the gate and up projections (one product where they lie side by side); `product`
    the op table's (`Kernels.linear`); `gated` the kind's `SILU_GATED` op, if the table has one,
    tried first where the two lie side by side and no `limit` clips them."""
    middle = None
    if gated is not None and limit is None and gate_up.together is not None and len(set(gate_up.sizes)) == 1:
        middle = gated(h, gate_up.together)
    if middle is None:
        middle = fused(silu_mul)(*gate_up(h), limit)
    return product(middle, down)


def swiglu_part(leaf: str, weight: torch.Tensor, inner: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of a SwiGLU's projection `leaf` (`PROJECTIONS`) of `inner` features:
    the gate's and up's rows, the down projection's columns."""
    part = own(rank, inner // world)
    return spans(weight, 1 if leaf == PROJECTIONS[2] else 0, part)


def swiglu_shapes(D: int, inner: int, prefix: str) -> dict[str, tuple[int, ...]]:
    gate, up, down = (prefix + name for name in PROJECTIONS)
    return {gate: (inner, D), up: (inner, D), down: (D, inner)}


class MLPFeed:
    def __init__(self, params: dict[str, torch.Tensor], prefix: str, kernels):
        gate, up, down = (params[prefix + name] for name in PROJECTIONS)
        self.gate_up = Products(gate, up, together=kernels.together, linear=kernels.linear)
        self.down, self.fused, self.linear = down, kernels.fused, kernels.linear
        self.gated = kernels.ops.get(SILU_GATED)

    def bind(self, txn):
        return lambda h, step: swiglu(h, self.gate_up, self.down, self.fused, self.linear, gated=self.gated)


class MLP(Kind):
    name = "mlp"
    role = "ffn"
    section = MLPSection
    quantized = PROJECTIONS
    outputs = ("down_proj.weight",)
    side_by_side = (PROJECTIONS[:2],)
    shards = "split"            # by inner features

    def shard_section(self, section, world):
        return dataclasses.replace(section, intermediate=divided("inner features", section.intermediate, world))

    def shard_weight(self, s, leaf, weight, rank, world):
        return swiglu_part(leaf, weight, s.section(MLPSection).intermediate, rank, world)

    def weights(self, s, prefix):
        return swiglu_shapes(s.hidden_size, s.section(MLPSection).intermediate, prefix)

    def owners(self, s, prefix, dtype, state_dtype):
        return []

    def init(self, leaf, shape, gen):
        return None

    def stage(self, s, params, layer, kernels, shared):
        return MLPFeed(params, f"layers.{layer}.mlp.", kernels)

    def cost(self, s, position):
        return Cost()

    def ops(self, mode, device, dtype):
        """In fast mode on CUDA, a 16-bit decode step's gate and up products and SwiGLU's middle
        in one kernel (`hebrus.ops.cuda.gemv.silu_gated`: one row by 16-bit weights, a row or two
        by quantized ones)."""
        if mode == "fast" and device is not None and device.type == "cuda" and dtype in (torch.bfloat16,
                                                                                        torch.float16):
            try:
                from hebrus.ops.cuda.gemv import silu_gated          # Triton
            except ImportError:
                return {}
            return {SILU_GATED: silu_gated}
        return {}
