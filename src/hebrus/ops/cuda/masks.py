"""A constraint's masks applied in one Triton kernel: the logits of every token a row's mask
does not allow set to -inf, the rest copied. The twin is `sampling.masked` (three kernels: the
words' bits spread out, compared, chosen), which this equals bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _masked_kernel(x_ptr, words_ptr, out_ptr, V, W, x_row, w_row, BLOCK: tl.constexpr):
    row, part = tl.program_id(1).to(tl.int64), tl.program_id(0)   # (row offsets past 2³¹ at 14K rows of 151,936)
    v = part * BLOCK + tl.arange(0, BLOCK)
    inside = v < V
    word = tl.load(words_ptr + row * w_row + v // 32, mask=inside & (v // 32 < W), other=0)
    allowed = ((word >> (v % 32)) & 1) != 0            # an arithmetic shift: bit 31 as any other
    x = tl.load(x_ptr + row * x_row + v, mask=inside, other=0.0)
    tl.store(out_ptr + row * V + v, tl.where(allowed, x, float("-inf")).to(x.dtype), mask=inside)


def masked(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """`rows` [B, V] with every token whose bit in `words` [B, W] (int32, on the same device;
    token i is bit i % 32 of word i // 32, tokens past 32·W not allowed) is clear at -inf: a new
    [B, V] tensor."""
    B, V = rows.shape
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    words = words.contiguous()
    out = torch.empty((B, V), dtype=rows.dtype, device=rows.device)
    if B and V:
        _masked_kernel[(triton.cdiv(V, BLOCK), B)](rows, words, out, V, words.shape[1], rows.stride(0),
                                                  words.stride(0), BLOCK=BLOCK)
    return out
