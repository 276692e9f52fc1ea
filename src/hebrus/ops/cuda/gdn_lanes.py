"""The gated delta rule for one token of each of N sessions, reading each state from the state
pool's bank where it lies and writing the new state into the other bank: no gather of the
states before, no scatter after (`hebrus.ops.gdn.gdn_lanes` is its readable twin, and the
contract). One program per (block of value columns, session, head); the state tile is held in
float32; the check of the written state (zero when finite, NaN when not) comes out beside o."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 32                 # value columns per program


@triton.jit
def _lanes(q, k, v, g, beta, bank, source, target, slots, o, check, parity_stride, slot_stride,
           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           NV: tl.constexpr):
    iv, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    parity, written = tl.load(source + n), tl.load(target + n)
    slot = tl.load(slots + n)
    rk, rv = tl.arange(0, BK), iv * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    tile = h * K * V + rk[:, None] * V + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    S = tl.load(bank + parity * parity_stride + slot * slot_stride + tile, mask=mask, other=0.0).to(tl.float32)
    bq = tl.load(q + nh * K + rk, mask=mk, other=0.0).to(tl.float32)
    bk = tl.load(k + nh * K + rk, mask=mk, other=0.0).to(tl.float32)
    bv = tl.load(v + nh * V + rv, mask=mv, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g + nh).to(tl.float32))
    rate = tl.load(beta + nh).to(tl.float32)
    S = S * decay
    recalled = tl.sum(S * bk[:, None], 0)
    u = rate * (bv - recalled)
    S = S + bk[:, None] * u[None, :]
    out = tl.sum(S * bq[:, None], 0)
    tl.store(bank + written * parity_stride + slot * slot_stride + tile,
             S.to(bank.dtype.element_ty), mask=mask)
    tl.store(o + nh * V + rv, out.to(o.dtype.element_ty), mask=mv)
    zeros = tl.where(mask, S * 0.0, 0.0)
    tl.store(check + nh * NV + iv, tl.sum(tl.sum(zeros, 1), 0))


def gdn_lanes_cuda(q, k, v, g, beta, bank, source, target, slots):
    N, H, K = q.shape
    V = v.shape[-1]
    NV = triton.cdiv(V, BV)
    q, k, v = (t.contiguous() for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    o = torch.empty((N, H, V), dtype=torch.float32, device=v.device)
    check = torch.empty((N, H, NV), dtype=torch.float32, device=v.device)
    _lanes[(NV, N * H)](q, k, v, g, beta, bank, source, target, slots, o, check, bank.stride(0), bank.stride(1),
                        H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, NV=NV)
    return o, check.sum(-1)
