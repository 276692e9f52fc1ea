"""One token of each of N sessions through a Gated DeltaNet's conv and delta rule, both states
read from the state pool's banks where they lie and the new ones written into the other bank: no
gather before, no scatter after (`hebrus.ops.gdn.gdn_lanes` is the readable twin, and the
contract). One kernel: a program per (session, value head, block of value columns)

- takes the conv's windows (each channel's last Kc-1 inputs) and new inputs of the channels it
  reads: its key head's q and k, its block of v. It forms SiLU of the convolution in float32 and
  writes the shifted windows: its v channels' always, its q and k channels' only where it is the
  first program of that key head (the others compute them again, a few hundred multiplies). The
  others read those windows while the first may be writing: from the public bank while it
  writes the private one, or, where a lane's two are one (`InPlace` with its source its target:
  the in-place measurement, `bench.inplace`), from a copy of the windows taken first;
- L2-normalises q and k, forms the gates from a and b, and steps its tile of the state (held in
  float32).

The gated output norm stays a kernel of its own: a program holding a whole head so that it
could norm it too took 9.5 µs a layer on an H100 against 5.7 + 1.8 for the two (9ae0784,
`benchmarks/results/cuda-h100/NOTES-aac5d6d.md`).

It writes two checks beside the states, one for the windows it wrote and one for its tile: zero
where the written values are finite, NaN where not.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.cuda.chain import after_the_last, chained

BV = 32                 # value columns per program


@triton.jit
def _conv(x, weight, windows, read, bank, written, new_at, rc, mc, write, K: tl.constexpr, KP: tl.constexpr):
    """Channels rc of one session: SiLU of the causal conv over their windows at offset `read` of
    `windows` and their new inputs at `new_at` of x, in float32; where `write`, the windows
    shifted by one written at offset `written` of `bank` -> (values, the check of what was
    written: 0 where finite, NaN where not)."""
    rk = tl.arange(0, KP)
    mk = rk < K - 1
    taps_at = rc[:, None] * (K - 1) + rk[None, :]                                       # [channels, KP]
    both = mc[:, None] & mk[None, :]
    window = tl.load(windows + read + taps_at, mask=both, other=0.0).to(tl.float32)
    new = tl.load(x + new_at + rc, mask=mc, other=0.0).to(tl.float32)
    taps = tl.load(weight + rc[:, None] * K + rk[None, :], mask=both, other=0.0).to(tl.float32)
    last = tl.load(weight + rc * K + K - 1, mask=mc, other=0.0).to(tl.float32)
    y = tl.sum(window * taps, 1) + new * last
    # the window shifted by one: tap j takes tap j+1's input, the last the new one
    later = tl.load(windows + read + taps_at + 1, mask=mc[:, None] & (rk[None, :] < K - 2), other=0.0).to(tl.float32)
    shifted = tl.where(rk[None, :] == K - 2, new[:, None], later).to(bank.dtype.element_ty)
    kept = both & write
    tl.store(bank + written + taps_at, shifted, mask=kept)
    zeros = tl.where(kept, shifted.to(tl.float32) * 0.0, 0.0)
    return y / (1.0 + tl.exp(-y)), tl.sum(tl.sum(zeros, 1), 0)


@triton.jit
def _lanes(x, x_stride, b, a, ab_stride, conv_w, neg_a, dt_bias, windows, window_source, window_slots,
           window_parity_stride, window_slot_stride, conv_bank, conv_target, conv_slots, conv_parity_stride,
           conv_slot_stride, bank, source, target, slots, parity_stride, slot_stride, o,
           conv_check, check, scale, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
           V: tl.constexpr, KC: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           NV: tl.constexpr, CHAINED: tl.constexpr):
    after_the_last(CHAINED)
    nh, iv = tl.program_id(0), tl.program_id(1)         # sessions x heads on the axis without a 65,535 cap
    n, h = nh // H, nh % H
    hk = h // (H // HK)                                                  # the key head it shares
    rk, rv = tl.arange(0, BK), iv * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    # the conv: this session's windows read where they lie (the bank of its parity), the new ones
    # written into the other bank
    read = tl.load(window_source + n) * window_parity_stride + tl.load(window_slots + n) * window_slot_stride
    written = tl.load(conv_target + n) * conv_parity_stride + tl.load(conv_slots + n) * conv_slot_stride
    first = (iv == 0) & (h % (H // HK) == 0)                            # the program that writes q's and k's windows
    row = n * x_stride
    bq, cq = _conv(x, conv_w, windows, read, conv_bank, written, row, hk * K + rk, mk, first, KC, KP)
    bk, ck = _conv(x, conv_w, windows, read, conv_bank, written, row, HK * K + hk * K + rk, mk, first, KC, KP)
    bv, cv = _conv(x, conv_w, windows, read, conv_bank, written, row, 2 * HK * K + h * V + rv, mv, iv >= 0, KC, KP)
    tl.store(conv_check + nh * NV + iv, cq + ck + cv)
    # the delta rule
    parity, after, slot = tl.load(source + n), tl.load(target + n), tl.load(slots + n)
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
    tl.store(bank + after * parity_stride + slot * slot_stride + tile, S.to(bank.dtype.element_ty), mask=mask)
    tl.store(o + nh * V + rv, out, mask=mv)
    zeros = tl.where(mask, S * 0.0, 0.0)
    tl.store(check + nh * NV + iv, tl.sum(tl.sum(zeros, 1), 0))


def gdn_lanes_cuda(projected, b, a, conv_w, neg_a, dt_bias, heads, conv, recurrent):
    """`hebrus.ops.gdn.gdn_lanes` in one kernel. Each lane's source and target parities differ,
    or are one tensor (`state.context.InPlace`)."""
    HK, K, H, V = heads
    N, C = projected.shape
    Kc = conv_w.shape[1]
    # rows may lie apart (slices of one product's columns): each row's own values are dense
    projected, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (projected, b, a))
    if b.stride(0) != a.stride(0):
        b, a = b.contiguous(), a.contiguous()
    # q's and k's windows are read by every program of their key head and written by the first:
    # where a lane reads and writes one bank (the in-place measurement), they are read from a
    # copy taken first
    windows, (source, slots), strides = conv.bank, (conv.source, conv.slots), conv.bank.stride()[:2]
    if conv.source is conv.target:
        windows = conv.bank[conv.source, conv.slots]                       # [N, C, Kc-1]: lane i's at i
        lanes = torch.arange(N, device=projected.device)
        (source, slots), strides = (lanes, lanes), (windows.stride(0), 0)
    NV = triton.cdiv(V, BV)
    o = torch.empty((N, H, V), dtype=torch.float32, device=projected.device)
    conv_check, check = (torch.empty((N, H * NV), dtype=torch.float32, device=projected.device) for _ in range(2))
    chain = chained(projected.device)
    _lanes[(N * H, NV)](projected, projected.stride(0), b, a, b.stride(0), conv_w.contiguous(), neg_a.float().contiguous(),
                        dt_bias.float().contiguous(), windows, source, slots, *strides, conv.bank, conv.target,
                        conv.slots, conv.bank.stride(0), conv.bank.stride(1),
                        recurrent.bank, recurrent.source, recurrent.target,
                        recurrent.slots, recurrent.bank.stride(0), recurrent.bank.stride(1), o, conv_check, check,
                        K ** -0.5, HK=HK, H=H, K=K, V=V, KC=Kc, KP=triton.next_power_of_2(Kc - 1),
                        BK=triton.next_power_of_2(K), BV=BV, NV=NV, CHAINED=chain, launch_pdl=chain)
    return o, conv_check, check
