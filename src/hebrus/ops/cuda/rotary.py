"""A query's and a key's way into attention on CUDA: RMSNorm per head, then the rotation of its
first features (`hebrus.ops.rope.normed_rotated`, the readable twin, once for q and once for k),
for every head of q and of k in one kernel where the compiled twin took four.

A program takes one head of one token: the head's RMS, then each rotated feature and its partner
(the feature half the rotary width away) normed from the input again, so no program reads
another's output. As the twin does, the normed head is rounded to the model's dtype before it
is rotated, and the rotation rounded once.

With `into` (a planned step's lanes), the programs of k's heads also write the token's rotated k
and its v into the rows of two caches the step's tables name (the twin's `index_put`s): the
key's and value's way into the cache, no kernel of their own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.cuda.chain import after_the_last, chained


@triton.jit
def _rotate(q, q_row, k, k_row, wq, wk, out_q, out_k, cos, sin, table_row, eps, v_in, v_row, k_cache, v_cache,
            blocks, offsets, cache_block, cache_row, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
            R: tl.constexpr, BD: tl.constexpr, APPEND: tl.constexpr, CHAINED: tl.constexpr):
    after_the_last(CHAINED)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)          # a long chunk's offsets pass 2**31
    if h < HQ:
        x, out, weight = q + t * q_row + h * D, out_q + (t * HQ + h) * D, wq
    else:
        x, out, weight = k + t * k_row + (h - HQ) * D, out_k + (t * HK + h - HQ) * D, wk
    dtype = out_q.dtype.element_ty
    d = tl.arange(0, BD)
    inside, rotated = d < D, d < R
    v = tl.load(x + d, mask=inside, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(v * v, 0) / D + eps)
    normed = (v * scale * tl.load(weight + d, mask=inside, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    p = tl.load(x + partner, mask=rotated, other=0.0).to(tl.float32)
    p = (p * scale * tl.load(weight + partner, mask=rotated, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos + t * table_row + d, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin + t * table_row + d, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    y = tl.where(rotated, normed * c + tl.where(d < half, -p, p) * s, normed)
    tl.store(out + d, y.to(dtype), mask=inside)
    if APPEND:
        if h >= HQ:                    # k's head: its row and v's, at the token's block and row
            at = tl.load(blocks + t) * cache_block + tl.load(offsets + t) * cache_row + (h - HQ) * D
            tl.store(k_cache + at + d, y.to(dtype), mask=inside)
            tl.store(v_cache + at + d, tl.load(v_in + t * v_row + (h - HQ) * D + d, mask=inside), mask=inside)


def takes(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> bool:
    """q [T, hq, d] and k [T, hk, d] of a 16-bit model on one CUDA device, each head's features
    dense and heads one after another (rows may lie apart: slices of one product's columns); the
    norms' weights [d]; cos and sin [T, an even rotary width of at most d], dense; outside
    autograd (the kernel has no backward)."""
    d, width = q.shape[-1], cos.shape[-1]
    tensors = (q, k, wq, wk, cos, sin)
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and q.dim() == k.dim() == 3
            and all(x.device == q.device for x in tensors) and wq.shape == wk.shape == (d,)
            and k.shape[-1] == d and q.shape[0] == k.shape[0] == cos.shape[0] and sin.shape == cos.shape
            and width % 2 == 0 and width <= d and all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k))
            and cos.is_contiguous() and sin.is_contiguous()
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)))


def takes_into(k: torch.Tensor, into) -> bool:
    """`into` = (v, k_cache, v_cache, blocks, offsets): v [T, hk, d] laid as k may be; two caches
    [blocks, rows, hk, d] of k's dtype on its device, laid alike, each row's heads dense; blocks
    and offsets [T] int64 on that device, dense (the kernel writes where they say, unchecked)."""
    v, k_cache, v_cache, blocks, offsets = into
    T, HK, D = k.shape
    return (v.shape == k.shape and v.dtype == k.dtype and v.device == k.device and v.stride(2) == 1
            and v.stride(1) == D and all(c.dtype == k.dtype and c.device == k.device and c.dim() == 4
                                         and c.shape[2:] == (HK, D) and c.stride(3) == 1 and c.stride(2) == D
                                         for c in (k_cache, v_cache))
            and k_cache.stride() == v_cache.stride() and k_cache.shape == v_cache.shape
            and all(x.dtype == torch.int64 and x.device == k.device and x.shape == (T,) and x.stride(0) == 1
                    for x in (blocks, offsets))
            and not (torch.is_grad_enabled() and v.requires_grad))


def normed_rotated_pair(q, k, wq, wk, cos, sin, eps, into=None):
    """(normed_rotated(q, wq, cos, sin, eps), normed_rotated(k, wk, cos, sin, eps)) in one
    kernel, where it `takes` them; else None (the layer runs the twin's two ops). With `into`
    (`takes_into`), token t's rotated k and its v are written at row offsets[t] of block blocks[t]
    of the two caches as well (where it does not take `into`: None)."""
    if not takes(q, k, wq, wk, cos, sin) or (into is not None and not takes_into(k, into)):
        return None
    T, HQ, D = q.shape
    HK = k.shape[1]
    out_q = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    out_k = torch.empty((T, HK, D), dtype=k.dtype, device=k.device)
    v, k_cache, v_cache, blocks, offsets = into if into is not None else (k, out_k, out_k, cos, cos)
    chain = chained(q.device)
    if T:
        _rotate[(T, HQ + HK)](q, q.stride(0), k, k.stride(0), wq.contiguous(), wk.contiguous(), out_q, out_k,
                              cos, sin, cos.shape[1], eps, v, v.stride(0), k_cache, v_cache, blocks, offsets,
                              k_cache.stride(0), k_cache.stride(1),
                              HQ=HQ, HK=HK, D=D, R=cos.shape[1], BD=triton.next_power_of_2(D),
                              APPEND=into is not None, CHAINED=chain, launch_pdl=chain)
    return out_q, out_k
