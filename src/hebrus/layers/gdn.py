"""Gated DeltaNet, a mixer kind (Qwen3.5 layout): projections, causal conv, gated delta rule,
gated norm. Its state per layer: the conv's last Kc-1 inputs and the recurrent matrix S."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from hebrus.layers.kind import Cost, Kind, divided, own, spans, uniform
from hebrus.layers.sublayer import Sublayer
from hebrus.ops.gdn import (by_length, gdn_chunked, gdn_inputs, gdn_inputs_ragged, gdn_lanes, gdn_ragged, gdn_recurrent, gdn_recurrent_states,
                            gdn_states)
from hebrus.ops.norm import accum_dtype, gated_rms_norm
from hebrus.ops.quant import Products
from hebrus.state.context import StepContext
from hebrus.state.step import StepBatch
from hebrus.state.context import InPlace
from hebrus.state.owners import OwnerSpec


DELTA_RULE = "gdn.delta_rule"             # (q, k, v, g, beta, state) -> (o, state)
DELTA_RULE_EACH = "gdn.delta_rule_each"   # ... -> (o, the state after every token): a prefix transaction's chunk
GDN_LANES = "gdn.lanes"   # (projected, b, a, conv_w, neg_a, dt_bias, heads, conv, recurrent) -> (o, conv check, recurrent check): a token a lane, states in place
DELTA_RULE_RAGGED = "gdn.delta_rule_ragged"   # (..., states [N, ...], cu_seqlens, bounds) -> (o, states): N sessions' chunks


# the chunked (WY) form over a chunk; the recurrence for a single token
delta_rule_fast = by_length(gdn_chunked, gdn_recurrent)


@dataclass(frozen=True, slots=True)
class DeltaNetSection:
    key: ClassVar[str] = "gdn"
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def problems(self, s):
        if self.value_heads % self.key_heads:
            yield (f"delta-rule value heads ({self.value_heads}) must be a multiple of its key heads "
                   f"({self.key_heads})")

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class GatedDeltaNet:
    """The mixer's math over one step. A delta-rule kind that differs only in its projections,
    its decay's shape and its output norm (`layers.kda`) overrides `projections`, `rules`,
    `norm` and `lanes`."""
    rules = (DELTA_RULE, DELTA_RULE_EACH, DELTA_RULE_RAGGED)      # its ops: one chunk, every state, ragged
    norm = staticmethod(gated_rms_norm)
    lanes: str | None = GDN_LANES       # its op for a token a lane with states in place, if any

    def __init__(self, s, params: dict[str, torch.Tensor], prefix: str, kernels):
        g = s.section(DeltaNetSection)
        w = self.weights_of(params, prefix)
        self.kernels = kernels
        self.project = Products(*(w[name] for name in GDN.side_by_side[0]), together=kernels.together,
                                linear=kernels.linear)                                    # -> qkv, z, b, a
        self.w_out = w["out_proj.weight"]
        self.conv_w, self.norm_w = w["conv.weight"], w["norm.weight"]
        state = accum_dtype(self.conv_w.dtype)       # the recurrent state's dtype (the model's, widened)
        self.neg_a = (-w["A_log"].exp()).to(state)    # widening is exact: the same values as before
        self.dt_bias = w["dt_bias"].to(state)
        self.hk, self.hv, self.dk, self.dv = g.key_heads, g.value_heads, g.key_dim, g.value_dim
        self.eps = s.rms_norm_eps

    @staticmethod
    def weights_of(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}

    def projections(self, h: torch.Tensor):
        """h [T, D] -> (the q/k/v projection the conv reads, the output gate's z, b, a)."""
        return self.project(h)

    def __call__(self, h: torch.Tensor, conv_state: torch.Tensor, S: torch.Tensor,
                 at: StepBatch | None = None, each: bool = False):
        """h [T, D]; conv_state [Kc-1, conv_dim]; S [Hv, dk, dv]  ->  (y [T, D], conv_state, S).
        In a step of several sessions (`at`), conv_state and S are [N, ...], session i's i: the
        projections run over every token at once, the conv over every session's rows laid end
        to end (each after its own state's: `ops.conv.causal_conv_ragged`), and the delta rule over
        every session's tokens in one call (a varlen kernel on CUDA; N single tokens when each
        feeds one). N single tokens may also find both states where they lie (`InPlace`): then
        the conv and the delta rule are one op that writes them, and their checks come back in
        their place. With `each`, both states after every token ([T, ...]: a prefix
        transaction)."""
        T, kernels = h.shape[0], self.kernels
        projected, z, b, a = self.projections(h)
        if isinstance(S, InPlace):              # a token per lane, their states read and written where they lie
            o, conv_state, S = kernels.ops[self.lanes](projected, b, a, self.conv_w, self.neg_a, self.dt_bias,
                                                       (self.hk, self.dk, self.hv, self.dv), conv_state, S)
        elif at is None or at.sessions == 1:
            o, conv_state, S = self._recur(projected, b, a, conv_state, S, each)
        elif at.one_each:                         # N sequences of one token each
            o, conv_state, S = self._recur(projected[:, None], b[:, None], a[:, None], conv_state, S)
            o = o[:, 0]
        else:                                     # every session's conv in one call, the delta rule over all in one call
            *inputs, conv_state = kernels.fused(gdn_inputs_ragged)(
                projected, b, a, conv_state, self.conv_w, self.neg_a, self.dt_bias, (self.hk, self.dk, self.hv, self.dv),
                *at.windows(self.conv_w.shape[1]))
            o, S = kernels.ops[self.rules[2]](*inputs, S, at.cu_seqlens, at.bounds)
        o = kernels.fused(self.norm)(o, z.view(T, self.hv, self.dv), self.norm_w, self.eps)
        return kernels.linear(o.flatten(1), self.w_out), conv_state, S

    def _recur(self, projected, b, a, conv_state, S, each: bool = False):
        """The conv and the delta rule over one sequence (leading dims: several) -> (o, conv_state, S)."""
        kernels = self.kernels
        q, k, v, g, beta, conv_state = kernels.fused(gdn_inputs)(
            projected, b, a, conv_state, self.conv_w, self.neg_a, self.dt_bias, (self.hk, self.dk, self.hv, self.dv), each)
        o, S = kernels.ops[self.rules[1] if each else self.rules[0]](q, k, v, g, beta, S)
        return o, conv_state, S


class GDNMixer(Sublayer):
    """A delta-rule mixer: `rule` (a `GatedDeltaNet`, or a kind's subclass) over the layer's
    conv and recurrent state."""

    def __init__(self, s, params, layer: int, kernels, kind: str = "gdn", rule: type = GatedDeltaNet):
        super().__init__(s, params, layer, "mixer", kernels)
        self.name = f"layers.{layer}.{kind}"
        self.gdn = rule(s, params, self.name + ".", kernels)

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        conv, rec = self.name + ".conv", self.name + ".recurrent"

        def body(at, h, state, each=False):
            y, conv_state, S = self.gdn(h, *state, at=at, each=each)
            return y, (conv_state, S)

        in_place = getattr(txn, "in_place", None)      # a planned step: states where they lie
        takes = (in_place is not None and batch.token_a_lane and not batch.each
                 and self.gdn.lanes in self.kernels.ops)
        lanes = in_place(rec) if takes else None
        if lanes is not None:                # the op wrote both states; what it gives back are their checks
            checks = self.framed(batch, body, (in_place(conv), lanes))
            txn.wrote(conv, checks[0])
            txn.wrote(rec, checks[1])
            return
        conv_state, S = self.framed(batch, body, (txn.read(conv).transpose(-1, -2), txn.read(rec)), ragged=True)
        write = txn.write_each if batch.keeps else txn.write
        write(conv, conv_state.transpose(-1, -2))
        write(rec, S)


class GDN(Kind):
    name = "gdn"
    role = "mixer"
    section = DeltaNetSection
    quantized = ("in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight")
    wide = ("A_log", "dt_bias")
    outputs = ("out_proj.weight",)
    side_by_side = (("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),)
    shards = "split"            # by key heads, each with its value heads (value head j reads key head j // group)

    def shard_section(self, section, world):
        return dataclasses.replace(section, key_heads=divided("key heads", section.key_heads, world),
                                   value_heads=section.value_heads // world)

    def shard_weight(self, s, leaf, weight, rank, world):
        """q, k and v rows of its heads (the conv's channels alike), z, b, a, the decays and the
        out projection's columns by value heads; the norm (over one head) whole."""
        g = s.section(DeltaNetSection)
        hk, hv = g.key_heads // world, g.value_heads // world
        if leaf in ("in_proj_qkv.weight", "conv.weight"):
            width = g.key_heads * g.key_dim
            return spans(weight, 0, own(rank, hk * g.key_dim), own(rank, hk * g.key_dim, width),
                         own(rank, hv * g.value_dim, 2 * width))
        if leaf == "in_proj_z.weight":
            return spans(weight, 0, own(rank, hv * g.value_dim))
        if leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            return spans(weight, 0, own(rank, hv))
        if leaf == "out_proj.weight":
            return spans(weight, 1, own(rank, hv * g.value_dim))
        return weight

    def weights(self, s, prefix):
        g, D = s.section(DeltaNetSection), s.hidden_size
        Hv, dv = g.value_heads, g.value_dim
        return {
            f"{prefix}in_proj_qkv.weight": (g.conv_dim, D),
            f"{prefix}in_proj_z.weight": (Hv * dv, D),
            f"{prefix}in_proj_b.weight": (Hv, D),
            f"{prefix}in_proj_a.weight": (Hv, D),
            f"{prefix}conv.weight": (g.conv_dim, g.conv_kernel),
            f"{prefix}A_log": (Hv,),
            f"{prefix}dt_bias": (Hv,),
            f"{prefix}norm.weight": (dv,),
            f"{prefix}out_proj.weight": (D, Hv * dv),
        }

    def owners(self, s, prefix, dtype, state_dtype):
        g = s.section(DeltaNetSection)
        return [OwnerSpec(prefix + "conv", (g.conv_dim, g.conv_kernel - 1), dtype),
                OwnerSpec(prefix + "recurrent", (g.value_heads, g.key_dim, g.value_dim), state_dtype)]

    def init(self, leaf, shape, gen):
        """Decays in their unsaturated range: A = e^A_log in [1, 8], softplus(dt_bias) in [0.01, 0.1]."""
        if leaf == "A_log":
            return uniform(shape, 1.0, 8.0, gen).log()
        if leaf == "dt_bias":
            return uniform(shape, 0.01, 0.1, gen).expm1().log()                 # softplus⁻¹
        return None

    def stage(self, s, params, layer, kernels, shared):
        return GDNMixer(s, params, layer, kernels)

    def cost(self, s, position):
        return Cost()

    def ops(self, mode, device, dtype):
        """Exact: the recurrence, token by token. Fast: the chunked form; for a 16-bit model on
        CUDA, fla's kernels when fla is installed (`hebrus.ops.cuda.gdn`; their TF32 dots would
        not meet float32's fast bound). Their readable twins are `ops.gdn`."""
        if mode != "fast":
            return {DELTA_RULE: gdn_recurrent, DELTA_RULE_EACH: gdn_recurrent_states,
                    DELTA_RULE_RAGGED: gdn_ragged(gdn_recurrent)}
        rule, ragged, lanes = delta_rule_fast, gdn_ragged(delta_rule_fast), gdn_lanes
        if device is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
            from hebrus.ops.cuda import gdn as cuda_gdn
            if cuda_gdn.available():
                from hebrus.ops.cuda.gdn_lanes import gdn_lanes_cuda
                rule, ragged, lanes = cuda_gdn.gdn_fla, cuda_gdn.gdn_fla_ragged, gdn_lanes_cuda
        return {DELTA_RULE: rule, DELTA_RULE_EACH: gdn_states, DELTA_RULE_RAGGED: ragged, GDN_LANES: lanes}
