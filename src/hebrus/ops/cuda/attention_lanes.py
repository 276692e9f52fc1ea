"""Dense attention of one query per session over its rows, read through its block table where
they lie in the state pool: no gather of the rows before (`hebrus.ops.qsa.dense_attention_lanes`
is its readable twin, and the contract). One program per (session, K/V head): the group of query
heads that share the K/V head against each block of rows up to the session's position in turn,
with a running softmax (maximum and sum kept in float32), so a session reads its own rows and
no more, whatever the table's width. The products take their 16-bit operands as float32 (on
Hopper TF32, which holds a bfloat16 or float16 value exactly) and add in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lanes(q, k, v, tables, positions, o, W, scale, k_block, k_row, k_head, v_block, v_row, v_head,
           HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
           R: tl.constexpr, RP: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    position = tl.load(positions + n)
    rg, rd, rr = tl.arange(0, GP), tl.arange(0, DP), tl.arange(0, RP)
    mg, md = rg < G, rd < D
    heads = h * G + rg
    bq = tl.load(q + (n * HQ + heads)[:, None] * D + rd[None, :], mask=mg[:, None] & md[None, :],
                 other=0.0).to(tl.float32)
    top = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for b in range(0, position // R + 1):
        block = tl.load(tables + n * W + b)
        visible = (rr < R) & (b * R + rr <= position)
        rows = visible[:, None] & md[None, :]
        bk = tl.load(k + block * k_block + rr[:, None] * k_row + h * k_head + rd[None, :], mask=rows,
                     other=0.0).to(tl.float32)
        scores = tl.dot(bq, tl.trans(bk)) * scale                                        # [GP, RP]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        weights = tl.exp(scores - new_top[:, None])
        fade = tl.exp(top - new_top)
        total = total * fade + tl.sum(weights, 1)
        bv = tl.load(v + block * v_block + rr[:, None] * v_row + h * v_head + rd[None, :], mask=rows,
                     other=0.0).to(tl.float32)
        acc = acc * fade[:, None] + tl.dot(weights, bv)
        top = new_top
    tl.store(o + (n * HQ + heads)[:, None] * D + rd[None, :], (acc / total[:, None]).to(o.dtype.element_ty),
             mask=mg[:, None] & md[None, :])


def attention_lanes_cuda(q, k_blocks, v_blocks, tables, positions) -> torch.Tensor:
    """q [N, Hq, dh]; k_blocks, v_blocks [B, R, Hkv, dh] (each row's heads and values dense);
    tables [N, W]; positions [N] -> o [N, Hq, dh] in q's dtype."""
    N, HQ, D = q.shape
    R, HKV = k_blocks.shape[1], k_blocks.shape[2]
    G = HQ // HKV
    for blocks in (k_blocks, v_blocks):
        if blocks.stride(3) != 1 or blocks.stride(2) != D:
            raise ValueError("the lanes' attention kernel reads rows whose heads and values are dense")
    q, tables, positions = q.contiguous(), tables.contiguous(), positions.contiguous()
    o = torch.empty_like(q)
    # tl.dot multiplies tiles of at least 16 along each side: the group, the rows and the values
    # are padded to that (and to a power of two), the padding masked off
    _lanes[(N, HKV)](q, k_blocks, v_blocks, tables, positions, o, tables.shape[1], D ** -0.5,
                     k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
                     v_blocks.stride(0), v_blocks.stride(1), v_blocks.stride(2),
                     HQ=HQ, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=max(16, triton.next_power_of_2(D)),
                     R=R, RP=max(16, triton.next_power_of_2(R)))
    return o


attention_lanes_cuda.reads_to_position = True      # its work ends at each lane's position, not the tables' width
