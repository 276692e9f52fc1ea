"""A 16-bit matrix-vector product for a batch-1 decode step in Triton: y = x Wᵀ for one row of x
and a dense weight whose rows are contiguous (a weight of its own, or several laid side by side:
`ops.quant.Products`). Each program reduces BLOCK_N outputs over the inputs in tiles of BLOCK_K,
keeping a [BLOCK_N, BLOCK_K] float32 partial sum and reducing it once at the end, in a fixed order:
the same inputs give the same bits. The twin is F.linear (`ops.quant.linear`), which runs every
other case (more rows, float32, a quantized weight).

`silu_gated` is SwiGLU's first half in one kernel: for gate and up projections laid side by side
([G; U], 2I x K), each program reduces BLOCK_N rows of each and writes silu(x Gᵀ) ⊙ x Uᵀ (each
product rounded to the row's dtype first, as the product alone writes it); the twin is the
product, then `ops.moe.silu_mul`. Quantized gate and up go to the quantized kernels' own
(`ops.cuda.quant.silu_gated`).

A launch is the fastest `benchmarks/gemv.py --update` measured for the weight's shape with cold
weights (`MEASURED`: on an H100 at a6ba9ba and 91da260 a 1.68B Qwen3.5 step's products took
1,261-1,280 µs so, against 1,464 through F.linear; `results/cuda-h100/gemv-*.txt`), else the
rule `launch_shape` keeps from the H200's measurement at 35fd8b0, timed with warm weights
(`results/cuda-h200/gemv-35fd8b0.txt`). The table is measured on one device and used on any.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.cuda import quant
from hebrus.ops.cuda.chain import after_the_last, chained
from hebrus.ops.quant import Quantized, linear as linear_twin


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, row_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 CHAINED: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = n.to(tl.int64) * row_stride          # a large head's offsets pass 2**31
    k = tl.arange(0, BLOCK_K)
    # the weight's first tile: no kernel of a step writes a weight, so it is read before waiting
    # for the kernel before this one (`ops.cuda.chain`)
    w = tl.load(w_ptr + row[:, None] + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
    after_the_last(CHAINED)
    acc = w.to(tl.float32) * tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


# (N, K) -> (BLOCK_N, BLOCK_K, warps): the fastest launch for that weight as `benchmarks/gemv.py
# --update` measured it (cold weights, as a decode step reads them) and wrote it here, on the device
# named (the last to write; rows of shapes that run did not time are kept); `launch_shape` falls back
# to its rule for any other shape.
MEASURED: dict[tuple[int, int], tuple[int, int, int]] = {   # NVIDIA H100 80GB HBM3
    (2048, 2048): (2, 1024, 4),
    (2048, 6144): (2, 2048, 2),
    (5120, 2048): (2, 2048, 8),
    (8224, 2048): (2, 2048, 8),
    (12288, 2048): (2, 2048, 8),
    (151936, 2048): (2, 1024, 4),
}


@triton.jit
def _silu_gated_kernel(x_ptr, w_ptr, y_ptr, N, K, row_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       CHAINED: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_row = n.to(tl.int64) * row_stride
    up_row = (n + N).to(tl.int64) * row_stride              # up's rows follow the gate's N
    k = tl.arange(0, BLOCK_K)
    mask = (n[:, None] < N) & (k[None, :] < K)
    # the weights' first tiles, read before waiting (`_gemv_kernel`)
    first_gate = tl.load(w_ptr + gate_row[:, None] + k[None, :], mask=mask, other=0.0).to(tl.float32)
    first_up = tl.load(w_ptr + up_row[:, None] + k[None, :], mask=mask, other=0.0).to(tl.float32)
    after_the_last(CHAINED)
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    gate = first_gate * x[None, :]
    up = first_up * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        mask = (n[:, None] < N) & (k[None, :] < K)
        gate += tl.load(w_ptr + gate_row[:, None] + k[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
        up += tl.load(w_ptr + up_row[:, None] + k[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
    out = y_ptr.dtype.element_ty
    g = tl.sum(gate, axis=1).to(out).to(tl.float32)
    u = tl.sum(up, axis=1).to(out).to(tl.float32)
    tl.store(y_ptr + n, (g / (1.0 + tl.exp(-g)) * u).to(out), mask=n < N)


def launch_shape(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for a weight [N, K]: the measured launch for that shape, else the
    fastest measured at the nearest shape."""
    if (N, K) in MEASURED:
        return MEASURED[N, K]
    # few outputs (a quantized GDN's float b and a: 32 x 2048): a program a row, its whole width in
    # one tile; the rule below's 4 x 128, 8 warps took 5.2 us there, its rows in 8 programs of 16
    # tiles each (H100, 88910d2, results/cuda-h100/88910d2/); this one not yet timed alone
    if N <= 64:
        return 1, min(2048, triton.next_power_of_2(K)), 4
    # the rule: the H200's warm winners at 35fd8b0
    if N >= 100_000:                    # a vocabulary's head (151936 x 2048: 4 x 256, 2 warps)
        return 4, 256, 2
    if K >= 4096 or N <= 2048:          # 2048 x 6144 and 2048 x 2048: 4 x 128, 8 warps
        return 4, 128, 8
    if N >= 10_000:                     # 12288 x 2048: 16 x 128, 8 warps
        return 16, 128, 8
    return 4, 512, 2                    # 8224 x 2048 and 5120 x 2048


def gated_launch_shape(N: int, K: int) -> tuple[int, int, int]:
    """`silu_gated`'s launch for a [gate; up] weight [N, K]: the product's, each program taking
    half its rows from the gate and half from up (as many rows a program as the product's: on
    an H100 at 91da260 the gate and up weight 12288 x 2048 took 23.5 µs a step with twice them,
    18.0 µs with as many, as its product alone; `benchmarks/gemv.py`)."""
    block_n, block_k, warps = launch_shape(N, K)
    return max(1, block_n // 2), block_k, warps


def takes(x: torch.Tensor, w) -> bool:
    """Whether `linear` runs x Wᵀ here: one contiguous 16-bit row of x on a CUDA device and a
    dense weight of its dtype with contiguous rows, outside autograd (the kernel has no backward)."""
    return (type(w) is torch.Tensor and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and w.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.is_contiguous()
            and w.stride(1) == 1 and x.shape[1] == w.shape[1] and w.device == x.device
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def launch(x: torch.Tensor, w: torch.Tensor, shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K]ᵀ -> [1, N] with the given (BLOCK_N, BLOCK_K, warps), default
    `launch_shape` (what `takes` accepts only). `w` is a weight, which no kernel writes while the
    model runs: launched as a chain (`ops.cuda.chain`), its first tile is read before the kernel
    before this one has finished."""
    N, K = w.shape
    block_n, block_k, warps = shape or launch_shape(N, K)
    y = torch.empty(1, N, device=x.device, dtype=x.dtype)
    chain = chained(x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                             CHAINED=chain, num_warps=warps, launch_pdl=chain)
    return y


def silu_gated(x: torch.Tensor, w, shape: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """silu(x Gᵀ) ⊙ x Uᵀ [1, I] for w = [G; U] [2I, K] (SwiGLU's gate and up side by side) in one
    kernel, where `takes(x, w)`, with the given (BLOCK_N, BLOCK_K, warps), default
    `gated_launch_shape`; for a quantized w, the quantized kernels' (`quant.silu_gated`); else
    None (the caller runs the product and `ops.moe.silu_mul`)."""
    if isinstance(w, Quantized):
        return quant.silu_gated(x, w, shape)
    if not takes(x, w) or w.shape[0] % 2:
        return None
    N, K = w.shape[0] // 2, w.shape[1]
    block_n, block_k, warps = shape or gated_launch_shape(2 * N, K)
    y = torch.empty(1, N, device=x.device, dtype=x.dtype)
    chain = chained(x.device)
    _silu_gated_kernel[(triton.cdiv(N, block_n),)](x, w, y, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                   CHAINED=chain, num_warps=warps, launch_pdl=chain)
    return y


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x Wᵀ: one 16-bit row here (`takes`), anything else through the twin."""
    return launch(x, w) if takes(x, w) else linear_twin(x, w)
