"""Multi-stream hyper-connection (mHC) mixing with a Sinkhorn-projected stream mix.

X is [T, n, D] (n streams). Mixing runs in the parameters' precision (float32, or float64 for a
float64 model); the sublayer input and the new streams come back in X's dtype.
"""
from __future__ import annotations

import torch


def _mixes(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """r @ fnᵀ with r = vec(X) / sqrt(mean(vec(X)²) + eps)  -> [T, rows(fn)]."""
    x = X.flatten(1).to(fn.dtype)
    r = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return r @ fn.T


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, columns normalised, then (iters-1) rounds of rows-then-columns."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_pre(X, fn, base, scale, iters: int, hc_eps: float, rms_eps: float):
    """-> c [T, D] (the sublayer input, before its norm), post [T, n], comb [T, n, n]."""
    c, post, comb_logits = hc_gates(X, fn, base, scale, hc_eps, rms_eps)
    return c, post, sinkhorn(comb_logits, iters, hc_eps)


def hc_gates(X, fn, base, scale, hc_eps: float, rms_eps: float):
    """`hc_pre` up to the Sinkhorn projection: -> c [T, D], post [T, n], comb's logits [T, n, n]."""
    n = X.shape[1]
    m = _mixes(X, fn, rms_eps)
    pre = torch.sigmoid(scale[0] * m[:, :n] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(scale[1] * m[:, n:2 * n] + base[n:2 * n])
    comb_logits = (scale[2] * m[:, 2 * n:] + base[2 * n:]).unflatten(-1, (n, n))
    c = (pre.unsqueeze(-1) * X.to(pre.dtype)).sum(1)
    return c.to(X.dtype), post, comb_logits


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_k <- post_k · y + Σ_j comb[j, k] · X_j."""
    Xf, yf = X.to(comb.dtype), y.to(comb.dtype)
    mixed = (comb.unsqueeze(-1) * Xf.unsqueeze(2)).sum(1)      # [T, n(k), D]
    return (post.unsqueeze(-1) * yf.unsqueeze(1) + mixed).to(X.dtype)


def hc_head(X, fn, base, scale, hc_eps: float, rms_eps: float) -> torch.Tensor:
    """h = Σ_i pre_i X_i with pre = σ(scale · (r @ fnᵀ) + base) + eps  -> [T, D]."""
    pre = torch.sigmoid(scale[0] * _mixes(X, fn, rms_eps) + base) + hc_eps
    return (pre.unsqueeze(-1) * X.to(pre.dtype)).sum(1).to(X.dtype)
