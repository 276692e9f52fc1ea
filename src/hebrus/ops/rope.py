"""Rotary position embedding, rotate-half convention.

The cos/sin tables are computed once per model for every position, so a position's rotation is
the same bits whatever chunk it arrives in.
"""
from __future__ import annotations

import torch

from hebrus.ops.norm import rms_norm


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """θ^(-2i/dim) for each pair i of `dim` rotated values, in float64."""
    return theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def rope_tables(dim: int, theta: float, positions: int, dtype: torch.dtype, device=None):
    """cos, sin tables [positions, dim] with inverse frequencies θ^(-2i/dim), built in float64."""
    inv_freq = inverse_frequencies(dim, theta)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """x: [T, ..., d]; cos, sin: [T, rotary_dim]. Rotates the first rotary_dim features (default all)."""
    rd = cos.shape[-1] if rotary_dim is None else rotary_dim
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    cos, sin = cos[:, :rd].reshape(shape).to(x.dtype), sin[:, :rd].reshape(shape).to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def normed_rotated(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm per head, then the rotation: a query's or key's way into attention."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def normed_rotated_pair(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, eps: float, into=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A query's and a key's `normed_rotated`, each with its own norm's weight: the readable twin
    of a kernel that does both at once (`hebrus.ops.cuda.rotary`). With `into` = (v, k_cache,
    v_cache, blocks, offsets), token t's rotated k and its v are written at row offsets[t] of
    block blocks[t] of the caches [blocks, rows, *row] too (a planned step's rows, as its tables
    name them)."""
    q, k = normed_rotated(q, wq, cos, sin, eps), normed_rotated(k, wk, cos, sin, eps)
    if into is not None:
        v, k_cache, v_cache, blocks, offsets = into
        k_cache[blocks, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, offsets] = v.to(v_cache.dtype)
    return q, k
