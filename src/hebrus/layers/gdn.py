"""Gated DeltaNet mixer (Qwen3.5 layout): projections, causal conv, gated delta rule, gated norm."""
from __future__ import annotations

import torch

from hebrus.layers.spec import ModelSpec
from hebrus.ops.gdn import gdn_inputs
from hebrus.ops.norm import accum_dtype, gated_rms_norm
from hebrus.ops.quant import linear


class GatedDeltaNet:
    def __init__(self, c: ModelSpec, params: dict[str, torch.Tensor], prefix: str):
        w = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        self.w_qkv, self.w_z = w["in_proj_qkv.weight"], w["in_proj_z.weight"]
        self.w_b, self.w_a, self.w_out = w["in_proj_b.weight"], w["in_proj_a.weight"], w["out_proj.weight"]
        self.conv_w, self.norm_w = w["conv.weight"], w["norm.weight"]
        state = accum_dtype(self.conv_w.dtype)       # the recurrent state's dtype (the model's, widened)
        self.neg_a = (-w["A_log"].exp()).to(state)    # widening is exact: the same values as before
        self.dt_bias = w["dt_bias"].to(state)
        self.hk, self.hv, self.dk, self.dv = c.gdn_key_heads, c.gdn_value_heads, c.gdn_key_dim, c.gdn_value_dim
        self.eps = c.rms_norm_eps

    def __call__(self, h: torch.Tensor, conv_state: torch.Tensor, S: torch.Tensor, kernels,
                 sessions: bool = False, each: bool = False):
        """h [T, D]; conv_state [Kc-1, conv_dim]; S [Hv, dk, dv]  ->  (y [T, D], conv_state, S).
        With `sessions`, row i of h is one token of session i, whose states are conv_state[i]
        and S[i]. With `each`, both states after every token ([T, ...]: a prefix transaction)."""
        T = h.shape[0]
        projected, b, a = linear(h, self.w_qkv), linear(h, self.w_b), linear(h, self.w_a)
        if sessions:                              # B sequences of one token each
            projected, b, a = projected[:, None], b[:, None], a[:, None]
        q, k, v, g, beta, conv_state = kernels.fused(gdn_inputs)(
            projected, b, a, conv_state, self.conv_w, self.neg_a, self.dt_bias, (self.hk, self.dk, self.hv, self.dv), each)
        o, S = (kernels.delta_rule_each if each else kernels.delta_rule)(q, k, v, g, beta, S)          # sessions: B sequences of one token
        if sessions:
            o = o[:, 0]
        z = linear(h, self.w_z).view(T, self.hv, self.dv)
        o = kernels.fused(gated_rms_norm)(o.to(h.dtype), z, self.norm_w, self.eps)
        return linear(o.flatten(1), self.w_out), conv_state, S
