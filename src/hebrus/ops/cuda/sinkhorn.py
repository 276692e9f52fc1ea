"""The hyper-connection's Sinkhorn projection in one Triton kernel: each program holds BLOCK
tokens' n × n stream mixes in registers through every round. Compiled, the same function was two
kernels a round (the row sums and the column sums reduce over other axes), 38 a sublayer at 20
rounds: a fifth of a decode step of the `shakespeare` model on an H200. The twin is
`ops.hyper.sinkhorn`; float32 mixes run here, any other dtype (a float64 model's) runs the twin.

Sums run in a fixed order for a given n, whatever the launch: the same logits give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.cuda.chain import after_the_last, chained
from hebrus.ops.hyper import sinkhorn as sinkhorn_twin

ELEMENTS = 512           # a program's mixes: 32 tokens' 4 × 4, 2 tokens' 16 × 16
# One warp a program: the row and column sums then stay within a warp's lanes (no shared memory and
# no barrier between rounds). At 3858b57, with torch's default four warps, a decode step's call
# took 4.8 us on an H200 (n = 4, ten rounds); one warp not yet measured.
WARPS = 1


@triton.jit
def _sinkhorn_kernel(x_ptr, y_ptr, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                     BLOCK: tl.constexpr, CHAINED: tl.constexpr):
    after_the_last(CHAINED)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    inside = (t < T) & (i < N) & (j < N)
    at = t * (N * N) + i * N + j
    x = tl.load(x_ptr + at, mask=inside, other=0.0)
    # row softmax (entries outside the n × n mix count as -inf: zero after it) + eps
    x = tl.where(inside, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=2, keep_dims=True))
    e = tl.where(inside, e, 0.0)
    c = tl.where(inside, e / tl.sum(e, axis=2, keep_dims=True) + eps, 0.0)
    # entries outside divide by 1, never by a sum of zeros (0 / 0 with eps = 0 would spread NaN)
    c = c / tl.where(inside, tl.sum(c, axis=1, keep_dims=True) + eps, 1.0)
    for _ in tl.static_range(ITERS - 1):
        c = c / tl.where(inside, tl.sum(c, axis=2, keep_dims=True) + eps, 1.0)
        c = c / tl.where(inside, tl.sum(c, axis=1, keep_dims=True) + eps, 1.0)
    tl.store(y_ptr + at, c, mask=inside)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`ops.hyper.sinkhorn` over logits [T, n, n] on a CUDA device, in one kernel."""
    if logits.dtype != torch.float32 or logits.device.type != "cuda" or logits.dim() != 3:
        return sinkhorn_twin(logits, iters, eps)
    T, n, _ = logits.shape
    x = logits.contiguous()
    y = torch.empty_like(x)
    if T:
        padded = triton.next_power_of_2(n)
        block = max(1, ELEMENTS // (padded * padded))
        chain = chained(x.device)
        _sinkhorn_kernel[(triton.cdiv(T, block),)](x, y, T, eps, ITERS=iters, N=n, NP=padded, BLOCK=block,
                                                  num_warps=WARPS, CHAINED=chain, launch_pdl=chain)
    return y
