"""Routed experts with a gated shared expert, and the per-layer-embedding branch of the ffn."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from hebrus.config import HebrusConfig
from hebrus.model.kernels import Kernels
from hebrus.ops.moe import route
from hebrus.ops.norm import rms_norm


class MixtureOfExperts:
    def __init__(self, c: HebrusConfig, params: dict[str, torch.Tensor], prefix: str, kernels: Kernels,
                 site: str):
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.router, self.gate_up, self.down = w["router.weight"], w["experts.gate_up"], w["experts.down"]
        self.s_gate, self.s_up = w["shared.gate_proj.weight"], w["shared.up_proj.weight"]
        self.s_down, self.shared_gate = w["shared.down_proj.weight"], w["shared_gate.weight"]
        self.top_k, self.kernels, self.site = c.moe_top_k, kernels, site

    def route(self, h: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] at positions start.. -> (weights [T, k], experts [T, k], best first)."""
        return route(F.linear(h, self.router), self.top_k, partial(self.kernels.choose, self.site, start))

    def __call__(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        routed = self.kernels.experts(h, weights, experts, self.gate_up, self.down)
        shared = F.linear(F.silu(F.linear(h, self.s_gate)) * F.linear(h, self.s_up), self.s_down)
        return routed + torch.sigmoid(F.linear(h, self.shared_gate)) * shared


class LayerEmbedding:
    """PLE_l(h) = RMSNorm(W_down (gelu_tanh(W_gate h) ⊙ ple_t[l]))."""

    def __init__(self, c: HebrusConfig, params: dict[str, torch.Tensor], prefix: str):
        self.gate, self.down = params[prefix + "gate.weight"], params[prefix + "down.weight"]
        self.norm = params[prefix + "norm.weight"]
        self.eps = c.rms_norm_eps

    def __call__(self, h: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        mixed = F.gelu(F.linear(h, self.gate), approximate="tanh") * ple
        return rms_norm(F.linear(mixed, self.down), self.norm, self.eps)
