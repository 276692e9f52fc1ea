"""Feed-forward layers: routed experts with an optional gated shared expert, the dense MLP, and
the per-layer-embedding branch of the Hebrus ffn."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from hebrus.layers.kernels import Kernels, unfused
from hebrus.layers.spec import ModelSpec
from hebrus.ops.moe import route, silu_mul
from hebrus.ops.norm import rms_norm
from hebrus.ops.quant import linear


def _swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fused=unfused) -> torch.Tensor:
    return linear(fused(silu_mul)(linear(h, gate), linear(h, up)), down)


class MixtureOfExperts:
    def __init__(self, s: ModelSpec, params: dict[str, torch.Tensor], prefix: str, kernels: Kernels,
                 site: str):
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.router, self.gate_up, self.down = w["router.weight"], w["experts.gate_up"], w["experts.down"]
        self.shared = None
        if s.moe_shared_intermediate:
            self.shared = (w["shared.gate_proj.weight"], w["shared.up_proj.weight"], w["shared.down_proj.weight"])
            self.shared_gate = w["shared_gate.weight"]
        self.top_k, self.normalize, self.kernels, self.site = s.moe_top_k, s.moe_normalize, kernels, site

    def route(self, h: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] at positions start.. -> (weights [T, k], experts [T, k], best first)."""
        return route(linear(h, self.router), self.top_k, partial(self.kernels.choose, self.site, start),
                     normalize=self.normalize)

    def __call__(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        routed = self.kernels.experts(h, weights, experts, self.gate_up, self.down)
        if self.shared is None:
            return routed
        return routed + torch.sigmoid(linear(h, self.shared_gate)) * _swiglu(h, *self.shared, self.kernels.fused)


class MLP:
    """down(silu(gate(h)) ⊙ up(h))."""

    def __init__(self, params: dict[str, torch.Tensor], prefix: str, kernels: Kernels):
        self.weights = tuple(params[f"{prefix}{k}.weight"] for k in ("gate_proj", "up_proj", "down_proj"))
        self.fused = kernels.fused

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return _swiglu(h, *self.weights, self.fused)


class LayerEmbedding:
    """PLE_l(h) = RMSNorm(W_down (gelu_tanh(W_gate h) ⊙ ple_t[l]))."""

    def __init__(self, s: ModelSpec, params: dict[str, torch.Tensor], prefix: str):
        self.gate, self.down = params[prefix + "gate.weight"], params[prefix + "down.weight"]
        self.norm = params[prefix + "norm.weight"]
        self.eps = s.rms_norm_eps

    def __call__(self, h: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        mixed = F.gelu(linear(h, self.gate), approximate="tanh") * ple
        return rms_norm(linear(mixed, self.down), self.norm, self.eps)
