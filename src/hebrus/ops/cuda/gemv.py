"""A 16-bit matrix-vector product for a batch-1 decode step in Triton: y = x Wᵀ for one row of x
and a dense weight whose rows are contiguous (a weight of its own, or several laid side by side:
`ops.quant.Products`). Each program reduces BLOCK_N outputs over the inputs in tiles of BLOCK_K,
keeping a [BLOCK_N, BLOCK_K] float32 partial sum and reducing it once at the end, in a fixed order:
the same inputs give the same bits. The twin is F.linear (`ops.quant.linear`), which runs every
other case (more rows, float32, a quantized weight).

The product may also compute its row as it loads it (`after`): x = op(*args) for the elementwise
op that comes before a projection in a step (SwiGLU's middle before the down projection, a
delta rule's gated norm before its out projection, attention's output gate before its own), one
tile of inputs at a time, each program on its own. A step then launches one kernel where it
launched two; the row is read from the cache once per program, which costs less than a launch.
The twin is `ops.quant.linear_after`: the op, then the product.

On the H200 at 35fd8b0 (`benchmarks/gemv.py`, `results/cuda-h200/gemv-35fd8b0.txt`), the products
of a decode step of the 1.68B Qwen3.5 shape took 1,032 µs through F.linear and 833 µs through the
best launch per shape; `launch_shape` holds those winners (the shapes there: K = 2048 but one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.moe import silu_mul
from hebrus.ops.norm import gated_rms_norm, sigmoid_gated_rms_norm
from hebrus.ops.qsa import sigmoid_gated
from hebrus.ops.quant import linear as linear_twin

# what the product computes its row from (`_row`): the row itself, or an op's inputs
PLAIN = tl.constexpr(0)
SILU_MUL = tl.constexpr(1)          # silu(x) ⊙ a
SIGMOID_GATE = tl.constexpr(2)      # x ⊙ σ(a)
GATED_SILU = tl.constexpr(3)        # per head of BLOCK_K: RMS norm of x with weight b, ⊙ silu(a)
GATED_SIGMOID = tl.constexpr(4)     # ... ⊙ σ(a)


@triton.jit
def _row(x_ptr, a_ptr, b_ptr, k, K, eps, dtype: tl.constexpr, OP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Inputs k of the row, in float32 from values of the model's dtype, rounded to it where an op
    made them (once, at its end, as a fused op rounds)."""
    inside = k < K
    x = tl.load(x_ptr + k, mask=inside, other=0.0).to(tl.float32)
    if OP == SILU_MUL:
        up = tl.load(a_ptr + k, mask=inside, other=0.0).to(tl.float32)
        x = (x / (1.0 + tl.exp(-x)) * up).to(dtype).to(tl.float32)
    elif OP == SIGMOID_GATE:
        gate = tl.load(a_ptr + k, mask=inside, other=0.0).to(tl.float32)
        x = (x / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    elif OP == GATED_SILU or OP == GATED_SIGMOID:
        # the tile is one head: its RMS over it (the op reads the rule's output in the model's dtype)
        o = x.to(dtype).to(tl.float32)
        z = tl.load(a_ptr + k, mask=inside, other=0.0).to(tl.float32)
        weight = tl.load(b_ptr + (k % BLOCK_K)).to(tl.float32)
        y = o * tl.rsqrt(tl.sum(o * o, 0) / BLOCK_K + eps) * weight
        if OP == GATED_SILU:
            x = (y * (z / (1.0 + tl.exp(-z)))).to(dtype).to(tl.float32)
        else:
            x = (y / (1.0 + tl.exp(-z))).to(dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(x_ptr, a_ptr, b_ptr, w_ptr, y_ptr, N, K, row_stride, eps, OP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = n.to(tl.int64) * row_stride          # a large head's offsets pass 2**31
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _row(x_ptr, a_ptr, b_ptr, k, K, eps, y_ptr.dtype.element_ty, OP, BLOCK_K)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def launch_shape(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for a weight [N, K]: the fastest measured at the nearest shape."""
    if N >= 100_000:                    # a vocabulary's head (151936 x 2048: 4 x 256, 2 warps)
        return 4, 256, 2
    if K >= 4096 or N <= 2048:          # 2048 x 6144 and 2048 x 2048: 4 x 128, 8 warps
        return 4, 128, 8
    if N >= 10_000:                     # 12288 x 2048: 16 x 128, 8 warps
        return 16, 128, 8
    return 4, 512, 2                    # 8224 x 2048 and 5120 x 2048


def takes(x: torch.Tensor, w) -> bool:
    """Whether `linear` runs x Wᵀ here: one contiguous 16-bit row of x on a CUDA device and a
    dense weight of its dtype with contiguous rows, outside autograd (the kernel has no backward)."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and x.dtype == w.dtype
            and not (torch.is_grad_enabled() and x.requires_grad) and _takes_weight(w, x.shape[1], x.device))


def _takes_weight(w, K: int, device: torch.device) -> bool:
    """A dense 16-bit weight [N, K] with contiguous rows on `device`, a CUDA device, and no
    gradient to keep for it."""
    return (type(w) is torch.Tensor and device.type == "cuda" and w.dim() == 2 and w.shape[1] == K
            and w.dtype in (torch.bfloat16, torch.float16) and w.stride(1) == 1 and w.device == device
            and not (torch.is_grad_enabled() and w.requires_grad))


def launch(x: torch.Tensor, w: torch.Tensor, shape: tuple[int, int, int] | None = None, op=PLAIN,
           a: torch.Tensor | None = None, b: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [1, K] @ w [N, K]ᵀ -> [1, N] with the given (BLOCK_N, BLOCK_K, warps), default
    `launch_shape` (what `takes` accepts only); with `op`, the row computed from x, a and b
    first (`_row`; the gated norms' heads are BLOCK_K wide)."""
    N, K = w.shape
    block_n, block_k, warps = shape or launch_shape(N, K)
    y = torch.empty(1, N, device=x.device, dtype=w.dtype)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, x if a is None else a, x if b is None else b, w, y, N, K, w.stride(0),
                                             eps, OP=op, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x Wᵀ: one 16-bit row here (`takes`), anything else through the twin."""
    return launch(x, w) if takes(x, w) else linear_twin(x, w)


def after(op, args: tuple, w) -> torch.Tensor | None:
    """linear(op(*args) with its heads flattened, w) in one kernel, where the row is one token's,
    16-bit, each of its inputs dense, and this kernel has `op` (`_row`); else None (the table
    then runs the op and the product: `Kernels.linear_after`)."""
    code = AFTER.get(op)
    x = args[0] if args else None
    if code is None or type(w) is not torch.Tensor or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] != 1:
        return None
    a, b, eps, head = args[1], None, 0.0, None
    if code == SILU_MUL and len(args) > 2 and args[2] is not None:         # SwiGLU's clipping: not here
        return None
    if code in (GATED_SILU, GATED_SIGMOID):
        b, eps, head = args[2], args[3], x.shape[-1]
        if (b.shape != (head,) or not b.is_contiguous() or b.device != x.device or head & (head - 1)
                or not 16 <= head <= 512):
            return None
    elif x.dtype != w.dtype:
        return None
    if (a.shape != x.shape or a.dtype != w.dtype or a.device != x.device
            or not (x[0].is_contiguous() and a[0].is_contiguous())
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, a, b)))
            or not _takes_weight(w, x[0].numel(), x.device)):
        return None
    block_n, block_k, warps = launch_shape(*w.shape)
    return launch(x, w, (block_n, head or block_k, warps), code, a, b, eps)


AFTER = {silu_mul: SILU_MUL, sigmoid_gated: SIGMOID_GATE, gated_rms_norm: GATED_SILU,
         sigmoid_gated_rms_norm: GATED_SIGMOID}
