"""The causal conv over a chunk of one sequence, with SiLU after it, in one Triton kernel: one
program per (block of rows, block of channels) sums each channel's K taps in float32, the first
K-1 rows taking their earlier inputs from the state (`hebrus.ops.conv.causal_conv` then SiLU is
the readable twin, and the contract)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 32                 # rows per program
BC = 128                # channels per program


@triton.jit
def _conv_silu(x, x_stride, state, state_row, state_col, weight, y, T, C: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr):
    it, ic = tl.program_id(0), tl.program_id(1)
    rt, rc = it * BT + tl.arange(0, BT), ic * BC + tl.arange(0, BC)
    mt, mc = rt < T, rc < C
    acc = tl.zeros((BT, BC), tl.float32)
    for j in tl.static_range(K):
        r = rt + j - (K - 1)                          # the input tap j reads; before 0: the state's row K-1+r
        fresh = tl.load(x + r[:, None] * x_stride + rc[None, :], mask=((r >= 0) & mt)[:, None] & mc[None, :], other=0.0)
        early = tl.load(state + (r + K - 1)[:, None] * state_row + rc[None, :] * state_col,
                        mask=((r < 0) & mt)[:, None] & mc[None, :], other=0.0)
        tap = tl.load(weight + rc * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += (fresh.to(tl.float32) + early.to(tl.float32)) * tap[None, :]
    tl.store(y + rt[:, None] * C + rc[None, :], (acc / (1.0 + tl.exp(-acc))).to(y.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


def conv_silu_cuda(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (rows may be strided), state [K-1, C] (any strides), weight [C, K] ->
    (SiLU of the conv [T, C] in x's dtype, the new state [K-1, C])."""
    T, C = x.shape
    K = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous()
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
    _conv_silu[grid](x, x.stride(0), state, state.stride(0), state.stride(1), weight, y, T, C, K, BT, BC)
    window = torch.cat([state.to(x.dtype), x[T - (K - 1):] if T >= K - 1 else x])
    return y, window[window.shape[0] - (K - 1):].clone()
