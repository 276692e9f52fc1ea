"""Gated delta rule: the per-token recurrence and its chunked (WY) twin.

Per head, with S ∈ R^{dk×dv} (float32, or float64 for a float64 model):
    S' = exp(g_t)·S ;  u = β_t (v_t − S'ᵀ k_t) ;  S = S' + k_t uᵀ ;  o_t = Sᵀ q_t
Shapes: q, k [T, H, dk] (already broadcast to value heads, q already scaled), v [T, H, dv],
g, beta [T, H], state [H, dk, dv]. Both functions return (o [T, H, dv], final state) and leave
`state` untouched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hebrus.ops.conv import causal_conv, causal_conv_ragged
from hebrus.ops.norm import l2_norm


def gdn_inputs(projected, b, a, conv_state, conv_w, neg_a, dt_bias, heads: tuple[int, int, int, int],
               each: bool = False):
    """The delta rule's inputs from the mixer's projections: the causal conv over the q/k/v
    projection, SiLU, per-head L2 norms (q also scaled by dk^-½), key heads repeated to the
    value heads, β = σ(b) and g = −A·softplus(a + dt_bias) in the state's dtype.
    projected [T, 2·hk·dk + hv·dv]; b, a [T, hv]; heads = (hk, dk, hv, dv)
    -> (q, k [T, hv, dk], v [T, hv, dv], g, beta [T, hv], conv_state). Leading dims before T are
    independent sequences (conv_state [B, Kc-1, C] then). With `each`, the conv state after every
    token [T, Kc-1, C] (one sequence)."""
    mixed, conv_state = causal_conv(projected, conv_state, conv_w, each)
    return (*gdn_activations(mixed, b, a, neg_a, dt_bias, heads), conv_state)


def gdn_inputs_ragged(projected, b, a, conv_states, conv_w, neg_a, dt_bias, heads: tuple[int, int, int, int],
                      gather, out, last):
    """`gdn_inputs` of N sessions' chunks in one call: projected, b, a [T, ...] their rows one
    after another, conv_states [N, Kc-1, C]; (gather, out, last) the conv's layout
    (`StepBatch.windows`, `ops.conv.causal_conv_ragged`) -> (q, k, v, g, beta [T, ...],
    conv_states [N, Kc-1, C]). Compiled, it takes one kernel for any rows (`any_rows`): its
    shapes vary with the sessions as well as the tokens."""
    mixed, conv_states = causal_conv_ragged(projected, conv_states, conv_w, (gather, out, last))
    return (*gdn_activations(mixed, b, a, neg_a, dt_bias, heads), conv_states)


gdn_inputs_ragged.any_rows = True
# the conv's state, read where a slot lies (a transposed view at the slot's offset), gathered
# from several slots, or left by the piece before, compiles one kernel (`ops.cuda.fuse`)
gdn_inputs.fresh = gdn_inputs_ragged.fresh = (3,)


def gdn_activations(mixed, b, a, neg_a, dt_bias, heads: tuple[int, int, int, int]):
    """`gdn_inputs` after the conv, row by row: mixed [T, 2·hk·dk + hv·dv] (the conv's output),
    b, a [T, hv] -> (q, k [T, hv, dk], v [T, hv, dv], g, beta [T, hv])."""
    hk, dk, hv, dv = heads
    lead = mixed.shape[:-1]
    q, k, v = F.silu(mixed).split([hk * dk, hk * dk, hv * dv], dim=-1)
    group = hv // hk
    q = (l2_norm(q.reshape(*lead, hk, dk)) * dk ** -0.5).repeat_interleave(group, dim=-2)
    k = l2_norm(k.reshape(*lead, hk, dk)).repeat_interleave(group, dim=-2)
    beta = torch.sigmoid(b.to(neg_a.dtype))
    g = neg_a * F.softplus(a.to(neg_a.dtype) + dt_bias)
    return q, k, v.reshape(*lead, hv, dv), g, beta


def gdn_recurrent(q, k, v, g, beta, state):
    """Token by token, straight from the definition. Leading dims before T are independent
    sequences (q [B, T, H, dk], state [B, H, dk, dv]). A decay per key channel (g shaped as k:
    Kimi delta attention, `ops.kda`) scales each row of S by its own."""
    S = state.clone()
    q, k, v, g, beta = (t.to(S.dtype) for t in (q, k, v, g, beta))
    per_channel = g.dim() == k.dim()
    out = []
    for t in range(q.shape[-3]):
        qt, kt, vt = q[..., t, :, :], k[..., t, :, :], v[..., t, :, :]
        decay = torch.exp(g[..., t, :, :] if per_channel else g[..., t, :])
        S = S * (decay[..., None] if per_channel else decay[..., None, None])
        recalled = (S * kt[..., None]).sum(-2)                          # Sᵀk  [..., H, dv]
        u = beta[..., t, :][..., None] * (vt - recalled)
        S = S + kt[..., None] * u[..., None, :]
        out.append((S * qt[..., None]).sum(-2))
    return torch.stack(out, dim=-3), S


def gdn_recurrent_states(q, k, v, g, beta, state):
    """`gdn_recurrent` keeping the state after every token: (o [T, H, dv], states [T, H, dk, dv]).
    The readable twin of `gdn_states`."""
    outs, states = [], []
    for t in range(q.shape[0]):
        o, state = gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(o)
        states.append(state)
    return torch.cat(outs), torch.stack(states)


def gdn_states(q, k, v, g, beta, state):
    """The state after every token of a short chunk at once, and the outputs from them:
    (o [T, H, dv], states [T, H, dk, dv]), the chunk as one block of the chunked form below,
        S_t = Γ_t S₀ + Σ_{j≤t} (Γ_t/Γ_j) k_j u_jᵀ ,   o_t = S_tᵀ q_t .
    It holds T states (T·H·dk·dv values), so it is meant for drafts, not prompts."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    dt = state.dtype
    q, k, v, g, beta = (t.to(dt).transpose(0, 1) for t in (q, k, v, g, beta))     # heads first
    gamma64 = g.to(torch.float64).cumsum(-1)                                     # log Γ [H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
    decay = torch.exp((gamma64[..., :, None] - gamma64[..., None, :]).masked_fill(~causal, float("-inf"))).to(dt)
    strict = decay.masked_fill(torch.eye(T, dtype=torch.bool, device=k.device), 0.0)
    lower = beta[..., :, None] * (k @ k.transpose(-1, -2)) * strict             # L [H, T, T]
    gamma = gamma64.exp().to(dt)
    rhs = beta[..., None] * v - (beta * gamma)[..., None] * (k @ state)         # β⊙V − (β⊙Γ⊙K) S₀
    eye = torch.eye(T, dtype=dt, device=k.device)
    u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)   # [H, T, dv]
    # Σ_j decay[t, j] k_j u_jᵀ for every t: [H, T, T] @ [H, T, dk·dv]
    outer = (k[..., :, None] * u[..., None, :]).flatten(-2)
    states = gamma[..., None, None] * state[:, None] + (decay @ outer).view(H, T, dk, dv)
    o = (states * q[..., None]).sum(-2)                                           # S_tᵀ q_t
    return o.transpose(0, 1), states.transpose(0, 1)


def gdn_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same map, a chunk of tokens at a time.

    Within a chunk, with Γ_t = exp(Σ_{j≤t} g_j) and U the rows u_t:
        (I + L) U = β⊙V − (β⊙Γ⊙K) S₀,   L[t, j] = β_t (Γ_t/Γ_j) k_t·k_j  for j < t
        o_t = Γ_t S₀ᵀ q_t + Σ_{j≤t} (Γ_t/Γ_j) (q_t·k_j) u_j
        S_C = Γ_C S₀ + Σ_j (Γ_C/Γ_j) k_j u_jᵀ
    The tail is padded with k = v = β = g = 0, which leaves the state alone.
    """
    T, dv, dt, n, (q, k, v, g, beta) = chunked_inputs(q, k, v, g, beta, state.dtype, chunk)
    H = k.shape[0]

    # log Γ [H, n, C], summed in float64: with strong decays the sum reaches hundreds, where a
    # float32 ulp (3e-5) would already be a 3e-5 relative error in every Γ_t/Γ_j below.
    gamma64 = g.to(torch.float64).cumsum(-1)
    gamma = gamma64.to(dt)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = torch.exp((gamma64[..., :, None] - gamma64[..., None, :]).masked_fill(~causal, float("-inf"))).to(dt)
    strict = decay.masked_fill(torch.eye(chunk, dtype=torch.bool, device=k.device), 0.0)

    lower = beta[..., :, None] * (k @ k.transpose(-1, -2)) * strict    # L  [H, n, C, C]
    eye = torch.eye(chunk, dtype=dt, device=k.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    u_from_v, w = solved[..., :dv], solved[..., dv:]                   # U = u_from_v − w S₀

    intra = (q @ k.transpose(-1, -2)) * decay                          # [H, n, C, C]
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * torch.exp(gamma64[..., -1:] - gamma64).to(dt)[..., None]

    S = state.clone()
    out = torch.empty(H, n, chunk, dv, dtype=dt, device=k.device)
    for c in range(n):
        u = u_from_v[:, c] - w[:, c] @ S
        out[:, c] = q_decayed[:, c] @ S + intra[:, c] @ u
        S = S * gamma[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.permute(1, 2, 0, 3).reshape(n * chunk, H, dv)[:T], S


def chunked_inputs(q, k, v, g, beta, dt: torch.dtype, chunk: int):
    """A chunked rule's inputs in `dt`, the tail padded with zeros to whole chunks, heads first:
    (T, dv, dt, n chunks, (q, k, v [H, n, C, d], g [H, n, C] or, a decay per channel, [H, n, C, dk],
    beta [H, n, C]))."""
    T, H, _ = k.shape
    pad = (-T) % chunk
    q, k, v, g, beta = (_pad(t.to(dt), pad) for t in (q, k, v, g, beta))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(n, chunk, H, -1).permute(2, 0, 1, 3) for t in (q, k, v))
    g = g.reshape(n, chunk, H, -1).permute(2, 0, 1, 3) if g.dim() == 3 else g.reshape(n, chunk, H).permute(2, 0, 1)
    return T, v.shape[-1], dt, n, (q, k, v, g, beta.reshape(n, chunk, H).permute(2, 0, 1))


def by_length(chunked, recurrent):
    """The fast rule over one sequence: `chunked` for a chunk, `recurrent` for a single token
    (also for several sessions' single tokens: q [B, 1, H, dk])."""
    def rule(q, k, v, g, beta, state):
        return (chunked if q.shape[-3] > 1 else recurrent)(q, k, v, g, beta, state)
    return rule


def gdn_ragged(rule):
    """`rule` (one sequence's, above) over N sequences of any lengths at once: q [T, H, dk] ...,
    state [N, H, dk, dv], sequence i rows bounds[i]..bounds[i+1] -> (o [T, H, dv], final states
    [N, ...]). Each sequence through `rule` on its own (the readable form of a varlen kernel;
    `cu_seqlens`, the bounds on the device, is what such a kernel takes)."""
    def ragged(q, k, v, g, beta, state, cu_seqlens, bounds):
        outs, states = [], []
        for i in range(len(bounds) - 1):
            a, b = bounds[i], bounds[i + 1]
            o, s = rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[i])
            outs.append(o)
            states.append(s)
        return torch.cat(outs), torch.stack(states)
    return ragged


def _pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    if not pad:
        return t
    return torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))], dim=0)


def gdn_lanes(projected, b, a, conv_w, neg_a, dt_bias, heads: tuple[int, int, int, int], conv, recurrent):
    """One token of each of N sessions through the conv and the delta rule, both states living
    in banks of the state pool: `conv` and `recurrent` are `state.context.InPlace` (session i
    reads bank[source[i], slots[i]] and writes the new state to bank[target[i], slots[i]]; the
    conv bank [2, slots, C, Kc-1], the recurrent one [2, slots, Hv, dk, dv]). projected [N, C];
    b, a [N, hv] -> (o [N, hv, dv], conv_check [N, C], recurrent_check [N, hv]: zero where the
    written state is finite, NaN where it is not). `gdn_inputs` and the recurrence as written:
    the readable twin of the CUDA kernels that read and write the banks where they lie."""
    window = conv.bank[conv.source, conv.slots].transpose(-1, -2)                    # [N, Kc-1, C]
    q, k, v, g, beta, window = gdn_inputs(projected[:, None], b[:, None], a[:, None], window, conv_w, neg_a,
                                          dt_bias, heads)
    window = window.transpose(-1, -2).to(conv.bank.dtype)
    conv.bank.index_put_((conv.target, conv.slots), window)
    o, S = gdn_recurrent(q, k, v, g, beta, recurrent.bank[recurrent.source, recurrent.slots])
    S = S.to(recurrent.bank.dtype)
    recurrent.bank.index_put_((recurrent.target, recurrent.slots), S)
    return o[:, 0], (window * 0).sum(-1), (S * 0).sum((-2, -1))
