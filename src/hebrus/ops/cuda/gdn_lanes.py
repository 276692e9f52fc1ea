"""One token of each of N sessions through a Gated DeltaNet's conv and delta rule, both states
read from the state pool's banks where they lie and the new ones written into the other bank: no
gather before, no scatter after (`hebrus.ops.gdn.gdn_lanes` is the readable twin, and the
contract). Two kernels:

- the conv: one program per (session, block of channels) takes each channel's window (its last
  Kc-1 inputs) and the new input, writes the shifted window and leaves SiLU of the convolution in
  float32;
- the delta rule: one program per (block of value columns, session, value head) L2-normalises
  its key head's q and k, forms the gates from a and b, and steps the state tile (held in
  float32).

Each writes a check beside its state: zero where the written values are finite, NaN where not.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BC = 128                # conv channels per program
BV = 32                 # value columns per program


@triton.jit
def _conv(x, x_stride, weight, bank, source, target, slots, mixed, check, parity_stride, slot_stride,
          C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr, NC: tl.constexpr):
    n, ic = tl.program_id(0), tl.program_id(1)
    parity, written, slot = tl.load(source + n), tl.load(target + n), tl.load(slots + n)
    rc, rk = ic * BC + tl.arange(0, BC), tl.arange(0, KP)
    mc, mk = rc < C, rk < K - 1
    at = slot * slot_stride + rc[:, None] * (K - 1) + rk[None, :]                      # [BC, KP]
    window = tl.load(bank + parity * parity_stride + at, mask=mc[:, None] & mk[None, :], other=0.0).to(tl.float32)
    new = tl.load(x + n * x_stride + rc, mask=mc, other=0.0).to(tl.float32)
    taps = tl.load(weight + rc[:, None] * K + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0).to(tl.float32)
    last = tl.load(weight + rc * K + K - 1, mask=mc, other=0.0).to(tl.float32)
    y = tl.sum(window * taps, 1) + new * last
    tl.store(mixed + n * C + rc, y / (1.0 + tl.exp(-y)), mask=mc)
    # the window shifted by one: tap j takes tap j+1's input, the last the new one
    later = tl.load(bank + parity * parity_stride + at + 1, mask=mc[:, None] & (rk[None, :] < K - 2),
                    other=0.0).to(tl.float32)
    shifted = tl.where(rk[None, :] == K - 2, new[:, None], later).to(bank.dtype.element_ty)
    tl.store(bank + written * parity_stride + at, shifted, mask=mc[:, None] & mk[None, :])
    zeros = tl.where(mc[:, None] & mk[None, :], shifted.to(tl.float32) * 0.0, 0.0)
    tl.store(check + n * NC + ic, tl.sum(tl.sum(zeros, 1), 0))


@triton.jit
def _rule(mixed, b, a, ab_stride, neg_a, dt_bias, bank, source, target, slots, o, check, parity_stride, slot_stride, scale,
          C: tl.constexpr, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
    nh, iv = tl.program_id(0), tl.program_id(1)         # sessions x heads on the axis without a 65,535 cap
    n, h = nh // H, nh % H
    hk = h // (H // HK)                                                  # the key head it shares
    parity, written, slot = tl.load(source + n), tl.load(target + n), tl.load(slots + n)
    rk, rv = tl.arange(0, BK), iv * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    bq = tl.load(mixed + n * C + hk * K + rk, mask=mk, other=0.0)
    bk = tl.load(mixed + n * C + HK * K + hk * K + rk, mask=mk, other=0.0)
    bv = tl.load(mixed + n * C + 2 * HK * K + h * V + rv, mask=mv, other=0.0)
    bq = bq * tl.rsqrt(tl.sum(bq * bq, 0) + 1e-6) * scale
    bk = bk * tl.rsqrt(tl.sum(bk * bk, 0) + 1e-6)
    shift = tl.load(a + n * ab_stride + h).to(tl.float32) + tl.load(dt_bias + h)
    softplus = tl.where(shift > 20.0, shift, tl.log(1.0 + tl.exp(tl.where(shift > 20.0, 20.0, shift))))   # a NaN stays NaN
    decay = tl.exp(tl.load(neg_a + h) * softplus)
    rate = 1.0 / (1.0 + tl.exp(-tl.load(b + n * ab_stride + h).to(tl.float32)))
    tile = h * K * V + rk[:, None] * V + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    S = tl.load(bank + parity * parity_stride + slot * slot_stride + tile, mask=mask, other=0.0).to(tl.float32)
    S = S * decay
    recalled = tl.sum(S * bk[:, None], 0)
    u = rate * (bv - recalled)
    S = S + bk[:, None] * u[None, :]
    out = tl.sum(S * bq[:, None], 0)
    tl.store(bank + written * parity_stride + slot * slot_stride + tile, S.to(bank.dtype.element_ty), mask=mask)
    tl.store(o + nh * V + rv, out, mask=mv)
    zeros = tl.where(mask, S * 0.0, 0.0)
    tl.store(check + nh * NV + iv, tl.sum(tl.sum(zeros, 1), 0))


def gdn_lanes_cuda(projected, b, a, conv_w, neg_a, dt_bias, heads, conv, recurrent):
    HK, K, H, V = heads
    N, C = projected.shape
    Kc = conv_w.shape[1]
    # rows may lie apart (slices of one product's columns): each row's own values are dense
    projected, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (projected, b, a))
    if b.stride(0) != a.stride(0):
        b, a = b.contiguous(), a.contiguous()
    mixed = torch.empty((N, C), dtype=torch.float32, device=projected.device)
    NC, NV = triton.cdiv(C, BC), triton.cdiv(V, BV)
    conv_check = torch.empty((N, NC), dtype=torch.float32, device=projected.device)
    _conv[(N, NC)](projected, projected.stride(0), conv_w.contiguous(), conv.bank, conv.source, conv.target, conv.slots, mixed, conv_check,
                   conv.bank.stride(0), conv.bank.stride(1), C=C, K=Kc, KP=triton.next_power_of_2(Kc - 1), BC=BC, NC=NC)
    o = torch.empty((N, H, V), dtype=torch.float32, device=projected.device)
    check = torch.empty((N, H * NV), dtype=torch.float32, device=projected.device)
    _rule[(N * H, NV)](mixed, b, a, b.stride(0), neg_a.float().contiguous(), dt_bias.float().contiguous(), recurrent.bank,
                       recurrent.source, recurrent.target, recurrent.slots, o, check,
                       recurrent.bank.stride(0), recurrent.bank.stride(1), K ** -0.5,
                       C=C, HK=HK, H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, NV=NV)
    return o, conv_check, check
