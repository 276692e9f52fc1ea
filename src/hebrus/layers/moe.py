"""Routed experts with an optional gated shared expert, an ffn kind. A routed layer records its
chosen experts, a column a layer, in the model's `routes` rows."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from hebrus.layers.checks import Check
from hebrus.layers.kernels import Kernels
from hebrus.layers.kind import Cost, Kind, divided, normal, own, spans
from hebrus.layers.mlp import PROJECTIONS, SILU_GATED, swiglu, swiglu_part, swiglu_shapes
from hebrus.ops.moe import (experts_few_first, experts_gathered, experts_grouped, experts_grouped_mm,
                            experts_per_token, grouped_mm_supports, route, route_given, route_sigmoid,
                            sigmoid_gated_add)
from hebrus.ops.quant import Products
from hebrus.state.owners import APPENDED, OwnerSpec


EXPERTS = "moe.experts"         # (h, weights, experts, gate_up, down, limit=None) -> y
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass(frozen=True, slots=True)
class ExpertsSection:
    key: ClassVar[str] = "moe"
    experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int = 0        # 0: no shared expert
    normalize: bool = True              # renormalise the chosen experts' probabilities
    shared_gated: bool = True           # the shared expert's output gated by σ(h·w) (else added as it is)
    scoring: str = "softmax"            # "softmax" over the router's logits, or "sigmoid" (or
                                        # "sqrtsoftplus") of each, + a correction bias per expert
                                        # (`router.bias`) for the choice
    groups: int = 1                     # sigmoid: experts in this many groups, chosen among the
    top_groups: int = 1                 # ... `top_groups` best groups
    scale: float = 1.0                  # sigmoid: the chosen experts' weights times this
    limit: float = 0.0                  # > 0: SwiGLU's gate cut to at most it, up to [-limit, limit]

    def problems(self, s):
        if self.top_k > self.experts:
            yield f"experts per token ({self.top_k}) exceeds the experts ({self.experts})"
        if self.scoring not in SCORINGS:
            yield f"unknown expert scoring {self.scoring!r}; scorings are {', '.join(SCORINGS)}"
        if self.groups < 1 or self.experts % self.groups or not 1 <= self.top_groups <= self.groups:
            yield (f"{self.experts} experts in {self.groups} groups, {self.top_groups} of them chosen: the groups "
                   f"must divide the experts and at least one but at most every group be chosen")
        elif self.groups > 1 and (self.scoring == "softmax" or self.top_k > self.top_groups * self.experts // self.groups):
            yield (f"grouped routing takes sigmoid scoring and at most the chosen groups' experts per token "
                   f"({self.top_groups} x {self.experts // self.groups})")

    def unused(self, s) -> tuple[str, ...]:
        """Sigmoid routing's fields, with softmax scoring."""
        return ("groups", "top_groups", "scale") if self.scoring == "softmax" else ()


ROUTED = ("moe", "hash_moe")            # the ffn kinds that route (`layers.hash_moe` for the second)


def routed_layers(s) -> tuple[int, ...]:
    """The layers whose feed-forward is routed, in order (their routes are state)."""
    return tuple(i for i, kind in enumerate(s.ffns) if kind in ROUTED)


class MixtureOfExperts:
    def __init__(self, s, params: dict[str, torch.Tensor], prefix: str, kernels: Kernels, site: str):
        e = s.section(ExpertsSection)
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.router, self.gate_up, self.down = w["router.weight"], w["experts.gate_up"], w["experts.down"]
        self.shared, self.shared_gate = None, None
        if e.shared_intermediate:
            gate, up, down = (w["shared." + name] for name in PROJECTIONS)
            self.shared = (Products(gate, up, together=kernels.together, linear=kernels.linear), down)
            self.shared_gate = w["shared_gate.weight"] if e.shared_gated else None
        self.bias = w.get("router.bias")
        self.table = w.get("router.table")      # hash routing's experts per token id (`layers.hash_moe`)
        self.section, self.kernels, self.site = e, kernels, site

    def route(self, h: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] at positions start.. -> (weights [T, k], experts [T, k], best first)."""
        e, logits, choose = self.section, self.kernels.linear(h, self.router), partial(self.kernels.choose, self.site, start)
        if e.scoring != "softmax":
            groups = partial(self.kernels.choose, self.site + ".groups", start, ordered=False)
            return route_sigmoid(logits, self.bias, e.top_k, e.groups, e.top_groups, choose, groups,
                                 normalize=e.normalize, scale=e.scale, fused=self.kernels.fused,
                                 sqrt_softplus=e.scoring == "sqrtsoftplus")
        return route(logits, e.top_k, choose, normalize=e.normalize, fused=self.kernels.fused)

    def route_by_table(self, h: torch.Tensor, ids: torch.Tensor):
        """Hash routing: each token's experts are its row of the table [V, k] (nothing chosen),
        weighted by their router scores -> (weights, experts) [T, k]."""
        e, experts = self.section, self.table[ids]
        weights = route_given(self.kernels.linear(h, self.router), experts, e.normalize, e.scale, self.kernels.fused,
                              e.scoring == "sqrtsoftplus")
        return weights, experts

    def __call__(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        limit = self.section.limit or None
        routed = self.kernels.ops[EXPERTS](h, weights, experts, self.gate_up, self.down, limit)
        if self.shared is None:
            return routed
        shared = swiglu(h, *self.shared, self.kernels.fused, self.kernels.linear, limit,
                        self.kernels.ops.get(SILU_GATED))
        if self.shared_gate is None:
            return routed + shared
        return self.kernels.fused(sigmoid_gated_add)(routed, self.kernels.linear(h, self.shared_gate), shared)


class RoutedFeed:
    """The ffn function of one routed layer: route, check and record the experts, run them."""

    def __init__(self, s, params, layer: int, kernels: Kernels, kind: str = "moe"):
        self.moe = MixtureOfExperts(s, params, f"layers.{layer}.{kind}.", kernels, f"layers.{layer}.ffn")
        self.column, self.experts = routed_layers(s).index(layer), s.section(ExpertsSection).experts

    def bind(self, txn):
        routes = txn.rows("routes")

        def feed(h, step):
            if self.moe.table is not None:      # hash routing: by token id
                weights, experts = self.moe.route_by_table(h, step.ids)
            else:
                weights, experts = self.moe.route(h, step.start)
            txn.check_range(experts, self.experts, Check.ROUTE_RANGE)
            experts = experts.clamp(0, self.experts - 1)
            step.put([r.column(self.column) for r in routes], experts)
            return self.moe(h, weights, experts)
        return feed


class MoE(Kind):
    name = "moe"
    role = "ffn"
    section = ExpertsSection
    quantized = ("experts.gate_up", "experts.down") + tuple("shared." + name for name in PROJECTIONS)
    wide = ("router.bias",)
    outputs = ("experts.down", "shared.down_proj.weight")
    side_by_side = (tuple("shared." + name for name in PROJECTIONS[:2]),)
    shards = "split"        # every expert (and the shared one) by inner features; the router whole

    def shard_section(self, section, world):
        return dataclasses.replace(
            section, intermediate=divided("experts' inner features", section.intermediate, world),
            shared_intermediate=divided("shared expert's inner features", section.shared_intermediate, world))

    def shard_weight(self, s, leaf, weight, rank, world):
        """Each expert's gate and up rows ([E, 2I, D]: gate's I, then up's) and down columns of
        the rank's inner features; the shared expert's alike; the router and its table whole."""
        e = s.section(ExpertsSection)
        inner = e.intermediate // world
        if leaf == "experts.gate_up":
            return spans(weight, 1, own(rank, inner), own(rank, inner, e.intermediate))
        if leaf == "experts.down":
            return spans(weight, 2, own(rank, inner))
        if leaf.startswith("shared.") and leaf.removeprefix("shared.") in PROJECTIONS:
            return swiglu_part(leaf.removeprefix("shared."), weight, e.shared_intermediate, rank, world)
        return weight

    def weights(self, s, prefix):
        e, D = s.section(ExpertsSection), s.hidden_size
        E, I = e.experts, e.intermediate
        shapes = {f"{prefix}router.weight": (E, D), f"{prefix}experts.gate_up": (E, 2 * I, D),
                  f"{prefix}experts.down": (E, D, I)}
        if e.scoring != "softmax":
            shapes[f"{prefix}router.bias"] = (E,)
        if e.shared_intermediate:
            shapes |= swiglu_shapes(D, e.shared_intermediate, prefix + "shared.")
            if e.shared_gated:
                shapes[f"{prefix}shared_gate.weight"] = (1, D)
        return shapes

    def owners(self, s, prefix, dtype, state_dtype):
        return []

    def model_owners(self, s, dtype, state_dtype):
        """`routes`: a row a position, a column per routed layer (hash-routed ones too), its
        experts best first; declared by the first routed kind of the spec."""
        if next(kind for kind in s.ffns if kind in ROUTED) != self.name:
            return []
        e = s.section(ExpertsSection)
        return [OwnerSpec("routes", (len(routed_layers(s)), e.top_k), torch.int32, APPENDED, limit=e.experts)]

    def init(self, leaf, shape, gen):
        """The correction bias of sigmoid routing drawn small (it shifts choices, not weights)."""
        return normal(shape, 0.01, gen) if leaf == "router.bias" else None

    def stage(self, s, params, layer, kernels, shared):
        return RoutedFeed(s, params, layer, kernels)

    def cost(self, s, position):
        """A token uses top_k of the experts; routes are written, never read."""
        e = s.section(ExpertsSection)
        share = e.top_k / e.experts
        return Cost(shares={"experts.gate_up": share, "experts.down": share}, rows={"routes": 0})

    def ops(self, mode, device, dtype):
        """Exact: each token through its experts. Fast: grouped per expert (torch's grouped_mm
        where it runs: no host synchronisation), a decode step's few tokens gathered on a GPU
        (by quantized experts, each row through its expert's codes where they lie:
        `hebrus.ops.cuda.quant.experts`) and each through its experts on the CPU
        (`ops.moe.FEW_ROWS`)."""
        if mode != "fast":
            return {EXPERTS: experts_per_token}
        many = experts_grouped
        if device is not None and dtype is not None and grouped_mm_supports(device, dtype):
            many = experts_grouped_mm
        if device is None or device.type == "cpu":
            return {EXPERTS: experts_few_first(many, experts_per_token)}
        few = experts_gathered
        if device.type == "cuda":
            try:
                from hebrus.ops.cuda import quant          # Triton
                few = quant.experts                        # quantized stacks read where they lie
            except ImportError:
                pass
        return {EXPERTS: experts_few_first(many, few)}
