"""Quantized matrix-vector products in Triton, for the few rows of a decode step: y = x Wᵀ with W
read in its stored form (int8, int4 or fp8 codes and their scales) and rebuilt in registers, so
a step reads the quantized bytes once. The twin is `ops.quant.linear` (rebuild W, then F.linear);
for more than FEW_ROWS rows of x, or a layout these kernels do not take, it is what runs.

Each program computes BLOCK_N outputs of one row of x, walking the inputs a group (int4), a
block (fp8) or BLOCK_K inputs (int8) at a time, in a fixed order: the same inputs give the same
bits whatever the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.quant import Quantized, rebuilt_linear

FEW_ROWS = 16
BLOCK_N = 16


@triton.jit
def _int8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m, pid = tl.program_id(1), tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    s = tl.load(s_ptr + n, mask=n < N, other=0.0)
    tl.store(y_ptr + m * N + n, (acc * s).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, G, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    # w: [N, ceil(K/2)] bytes, input 2j in the low nibble of byte j; s, z: [N, G] per GROUP inputs.
    # A step takes BLOCK_K inputs (BLOCK_K / 2 bytes a row); inputs 2j and 2j + 1 share a group.
    m, pid = tl.program_id(1), tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    half = (K + 1) // 2
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, half, BLOCK_K // 2):
        j = j0 + tl.arange(0, BLOCK_K // 2)                      # bytes of this step
        even, odd = 2 * j, 2 * j + 1
        xe = tl.load(x_ptr + m * K + even, mask=even < K, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + m * K + odd, mask=odd < K, other=0.0).to(tl.float32)
        inside = (n[:, None] < N) & (j[None, :] < half)
        b = tl.load(w_ptr + n[:, None] * half + j[None, :], mask=inside, other=0).to(tl.int32)
        g = (2 * j) // GROUP
        s = tl.load(s_ptr + n[:, None] * G + g[None, :], mask=inside, other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + n[:, None] * G + g[None, :], mask=inside, other=0).to(tl.float32)
        else:
            z = 8.0
        lo, hi = (b & 15).to(tl.float32) - z, (b >> 4).to(tl.float32) - z
        acc += tl.sum(s * (lo * xe[None, :] + hi * xo[None, :]), axis=1)
    tl.store(y_ptr + m * N + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, GK, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    # s: [ceil(N/BLOCK), GK]; BLOCK_N divides BLOCK, so a program's rows share one scale row
    m, pid = tl.program_id(1), tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row = (pid * BLOCK_N) // BLOCK
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g in range(0, GK):
        k = g * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        s = tl.load(s_ptr + row * GK + g)
        acc += s * tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + m * N + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


def takes(x: torch.Tensor, w: Quantized) -> bool:
    """Whether the kernels take this product: a CUDA x of few rows in a 16- or 32-bit float (they
    accumulate in float32; a float64 model keeps its own precision through the twin), a single
    (not stacked) weight in its stored layout, fp8 blocks a power of two from BLOCK_N."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (x.is_cuda and 0 < rows <= FEW_ROWS and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and w.qweight.dim() == 2 and w.qweight.is_contiguous()
            and (w.format != "fp8" or (w.group % BLOCK_N == 0 and w.group & (w.group - 1) == 0))
            and (w.format != "int4" or w.group % 2 == 0))


def linear(x: torch.Tensor, w: Quantized) -> torch.Tensor:
    """`ops.quant.rebuilt_linear`, through the kernels where they take the product."""
    if not takes(x, w):
        return rebuilt_linear(x, w)
    return launch(x, w)


def launch(x: torch.Tensor, w: Quantized, block_n: int = BLOCK_N, block_k: int | None = None,
           warps: int = 8) -> torch.Tensor:
    """The kernel for w's format on x [..., K] (any device Triton runs on); `block_n` outputs a
    program (fp8: dividing the block), `block_k` inputs a step (int8, int4: a power of two), `warps`
    a program. The defaults are the fastest of benchmarks/quant_gemv.py's sweep on the H200."""
    block_k = block_k or (1024 if w.format == "int4" else 512)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M, N = x2.shape[0], w.qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), M)
    if w.format == "int8":
        _int8_kernel[grid](x2, w.qweight, w.scale, y, N, K, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    elif w.format == "int4":
        G = w.scale.shape[-1]
        zero = w.zero if w.zero is not None else w.scale
        _int4_kernel[grid](x2, w.qweight, w.scale.contiguous(), zero.contiguous(), y, N, K, G,
                           HAS_ZERO=w.zero is not None, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=w.group,
                           num_warps=warps)
    else:
        _fp8_kernel[grid](x2, w.qweight, w.scale.contiguous(), y, N, K, w.scale.shape[-1], BLOCK_N=block_n,
                          BLOCK=w.group, num_warps=warps)
    return y.view(*lead, N)
