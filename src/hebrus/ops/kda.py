"""Kimi delta attention (KDA): the gated delta rule with a decay per key channel, not per head.

Per head, with S ∈ R^{dk×dv} (float32, or float64 for a float64 model) and g_t ∈ R^{dk}:
    S' = diag(exp(g_t))·S ;  u = β_t (v_t − S'ᵀ k_t) ;  S = S' + k_t uᵀ ;  o_t = Sᵀ q_t
Shapes: q, k [T, H, dk] (q already scaled, both already L2-normed), v [T, H, dv], g [T, H, dk]
(log decays, ≤ 0), beta [T, H], state [H, dk, dv]. Both functions return (o [T, H, dv], final
state) and leave `state` untouched. `kda_recurrent` is the definition; `kda_chunked` its
chunked twin (`ops.gdn.gdn_chunked` with the decay taken channel by channel).
"""
from __future__ import annotations

import torch

from hebrus.ops.gdn import chunked_inputs, gdn_recurrent


# the definition: the gated delta rule's, which takes a decay per key channel (g shaped as k)
kda_recurrent = gdn_recurrent


def kda_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same map, a chunk of tokens at a time.

    Within a chunk, with G_t = Σ_{j≤t} g_j per channel and U the rows u_t:
        (I + L) U = β⊙V − β⊙(exp(G)⊙K) S₀,   L[t, j] = β_t Σ_c k_t[c] k_j[c] exp(G_t[c] − G_j[c])  (j < t)
        o_t = S₀ᵀ (exp(G_t)⊙q_t) + Σ_{j≤t} (Σ_c q_t[c] k_j[c] exp(G_t[c] − G_j[c])) u_j
        S_C = diag(exp(G_C)) S₀ + Σ_j (exp(G_C − G_j)⊙k_j) u_jᵀ
    Every exponent is a difference G_t − G_j with j ≤ t (never above 0), so no decay overflows.
    The tail is padded with k = v = β = g = 0, which leaves the state alone.
    """
    T, dv, dt, n, (q, k, v, g, beta) = chunked_inputs(q, k, v, g, beta, state.dtype, chunk)
    H = k.shape[0]

    # log decays summed in float64 (as `gdn_chunked`): G [H, n, C, dk]
    G64 = g.to(torch.float64).cumsum(-2)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    diff = (G64[..., :, None, :] - G64[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    decay = torch.exp(diff).to(dt)                                     # [H, n, C(t), C(j), dk]
    strict = ~torch.eye(chunk, dtype=torch.bool, device=k.device)

    kk = (k[..., :, None, :] * decay * k[..., None, :, :]).sum(-1)     # [H, n, C, C]
    lower = beta[..., :, None] * kk * strict
    eye = torch.eye(chunk, dtype=dt, device=k.device)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * (torch.exp(G64).to(dt) * k)], dim=-1)
    solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    u_from_v, w = solved[..., :dv], solved[..., dv:]                   # U = u_from_v − w S₀

    intra = (q[..., :, None, :] * decay * k[..., None, :, :]).sum(-1)  # [H, n, C, C], j ≤ t
    q_decayed = q * torch.exp(G64).to(dt)
    k_to_end = k * torch.exp(G64[..., -1:, :] - G64).to(dt)
    chunk_decay = torch.exp(G64[..., -1, :]).to(dt)                    # [H, n, dk]

    S = state.clone()
    out = torch.empty(H, n, chunk, dv, dtype=dt, device=k.device)
    for c in range(n):
        u = u_from_v[:, c] - w[:, c] @ S
        out[:, c] = q_decayed[:, c] @ S + intra[:, c] @ u
        S = S * chunk_decay[:, c][..., None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.permute(1, 2, 0, 3).reshape(n * chunk, H, dv)[:T], S
