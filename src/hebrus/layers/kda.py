"""Kimi delta attention (KDA), a mixer kind (Kimi-Linear's layout): the gated delta rule with a
decay per key channel (`ops.kda`), drawn through a low-rank forget gate, and an output norm
gated by σ of a low-rank projection. Its q/k/v projection, causal conv, L2 norms and β are Gated
DeltaNet's (`layers.gdn`), one key head per value head; its state per layer too: the conv's last
Kc-1 inputs and the recurrent matrix S."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from hebrus.layers.gdn import GatedDeltaNet, GDNMixer
from hebrus.layers.kind import Cost, Kind, divided, own, spans, uniform
from hebrus.ops.gdn import by_length, gdn_ragged, gdn_recurrent_states
from hebrus.ops.kda import kda_chunked, kda_recurrent
from hebrus.ops.norm import accum_dtype, sigmoid_gated_rms_norm
from hebrus.ops.quant import Products
from hebrus.state.owners import OwnerSpec

RULE = "kda.delta_rule"                 # (q, k, v, g [T, H, dk], beta, state) -> (o, state)
RULE_EACH = "kda.delta_rule_each"       # ... -> (o, the state after every token)
RULE_RAGGED = "kda.delta_rule_ragged"   # (..., states [N, ...], cu_seqlens, bounds) -> (o, states)
PROJECTED = ("in_proj_qkv.weight", "f_a_proj.weight", "b_proj.weight", "g_a_proj.weight")     # of h, side by side


# the chunked form over a chunk; the recurrence for a single token
rule_fast = by_length(kda_chunked, kda_recurrent)


@dataclass(frozen=True, slots=True)
class KdaSection:
    key: ClassVar[str] = "kda"
    heads: int
    key_dim: int
    value_dim: int
    gate_rank: int          # the forget and output gates' inner width (h -> rank -> heads x dim)
    conv_kernel: int

    def problems(self, s):
        return ()

    @property
    def conv_dim(self) -> int:
        return self.heads * (2 * self.key_dim + self.value_dim)


class KimiDeltaAttention(GatedDeltaNet):
    rules = (RULE, RULE_EACH, RULE_RAGGED)
    norm = staticmethod(sigmoid_gated_rms_norm)
    lanes = None

    def __init__(self, s, params: dict[str, torch.Tensor], prefix: str, kernels):
        d = s.section(KdaSection)
        w = self.weights_of(params, prefix)
        self.kernels = kernels
        self.project = Products(*(w[name] for name in PROJECTED), together=kernels.together,
                                linear=kernels.linear)                              # -> qkv, f_a, b, g_a
        self.f_b, self.g_b = w["f_b_proj.weight"], w["g_b_proj.weight"]
        self.w_out = w["o_proj.weight"]
        self.conv_w, self.norm_w = w["conv.weight"], w["norm.weight"]
        state = accum_dtype(self.conv_w.dtype)
        self.neg_a = (-w["A_log"].exp()).to(state)[:, None]                         # [H, 1]: a head's rate
        self.dt_bias = w["dt_bias"].to(state).view(d.heads, d.key_dim)              # per key channel
        self.hk = self.hv = d.heads
        self.dk, self.dv = d.key_dim, d.value_dim
        self.eps = s.rms_norm_eps

    def projections(self, h):
        """-> (q/k/v projection, the output gate [T, H·dv], b [T, H], the forget gate's input
        [T, H, dk]): both gates through their rank."""
        projected, f_a, b, g_a = self.project(h)
        linear = self.kernels.linear
        return projected, linear(g_a, self.g_b), b, linear(f_a, self.f_b).unflatten(-1, (self.hk, self.dk))


class KDA(Kind):
    name = "kda"
    role = "mixer"
    section = KdaSection
    quantized = ("in_proj_qkv.weight", "o_proj.weight")
    wide = ("A_log", "dt_bias")
    outputs = ("o_proj.weight",)
    side_by_side = (PROJECTED,)
    shards = "split"            # by heads; the gates' low-rank inputs (f_a, g_a) every head shares

    def shard_section(self, section, world):
        return dataclasses.replace(section, heads=divided("heads", section.heads, world))

    def shard_weight(self, s, leaf, weight, rank, world):
        """q, k and v rows of its heads (the conv's channels alike), b, the decays (A_log a
        head, dt_bias a key channel), the gates' second halves and the out projection's columns
        by heads; the gates' low-rank first halves and the norm (over one head) whole."""
        d = s.section(KdaSection)
        h = d.heads // world
        if leaf in ("in_proj_qkv.weight", "conv.weight"):
            width = d.heads * d.key_dim
            return spans(weight, 0, own(rank, h * d.key_dim), own(rank, h * d.key_dim, width),
                         own(rank, h * d.value_dim, 2 * width))
        if leaf in ("b_proj.weight", "A_log"):
            return spans(weight, 0, own(rank, h))
        if leaf in ("f_b_proj.weight", "dt_bias"):
            return spans(weight, 0, own(rank, h * d.key_dim))
        if leaf == "g_b_proj.weight":
            return spans(weight, 0, own(rank, h * d.value_dim))
        if leaf == "o_proj.weight":
            return spans(weight, 1, own(rank, h * d.value_dim))
        return weight

    def weights(self, s, prefix):
        d, D = s.section(KdaSection), s.hidden_size
        H, dk, dv, r = d.heads, d.key_dim, d.value_dim, d.gate_rank
        return {
            f"{prefix}in_proj_qkv.weight": (d.conv_dim, D),
            f"{prefix}f_a_proj.weight": (r, D),
            f"{prefix}b_proj.weight": (H, D),
            f"{prefix}g_a_proj.weight": (r, D),
            f"{prefix}f_b_proj.weight": (H * dk, r),
            f"{prefix}g_b_proj.weight": (H * dv, r),
            f"{prefix}conv.weight": (d.conv_dim, d.conv_kernel),
            f"{prefix}A_log": (H,),
            f"{prefix}dt_bias": (H * dk,),
            f"{prefix}norm.weight": (dv,),
            f"{prefix}o_proj.weight": (D, H * dv),
        }

    def owners(self, s, prefix, dtype, state_dtype):
        d = s.section(KdaSection)
        return [OwnerSpec(prefix + "conv", (d.conv_dim, d.conv_kernel - 1), dtype),
                OwnerSpec(prefix + "recurrent", (d.heads, d.key_dim, d.value_dim), state_dtype)]

    def init(self, leaf, shape, gen):
        """Decays in their unsaturated range: e^A_log in [1, 16], softplus(dt_bias) in [1e-3, 1e-1]
        (log-uniform)."""
        if leaf == "A_log":
            return uniform(shape, 1.0, 16.0, gen).log()
        if leaf == "dt_bias":
            return uniform(shape, math.log(1e-3), math.log(1e-1), gen).exp().expm1().log()     # softplus⁻¹
        return None

    def stage(self, s, params, layer, kernels, shared):
        return GDNMixer(s, params, layer, kernels, self.name, KimiDeltaAttention)

    def cost(self, s, position):
        return Cost()

    def ops(self, mode, device, dtype):
        """Exact: the recurrence, token by token. Fast: the chunked form (`ops.kda`); for a
        16-bit model on CUDA, fla's kernels when fla has them (`hebrus.ops.cuda.kda`). The
        states after every token of a chunk come from the recurrence in both."""
        if mode != "fast":
            return {RULE: kda_recurrent, RULE_EACH: gdn_recurrent_states, RULE_RAGGED: gdn_ragged(kda_recurrent)}
        rule, ragged = rule_fast, gdn_ragged(rule_fast)
        if device is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
            from hebrus.ops.cuda import kda as cuda_kda
            if cuda_kda.available():
                rule, ragged = cuda_kda.kda_fla, cuda_kda.kda_fla_ragged
        return {RULE: rule, RULE_EACH: gdn_recurrent_states, RULE_RAGGED: ragged}
