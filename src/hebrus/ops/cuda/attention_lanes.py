"""Dense attention of one query per session over its rows, read through its block table where
they lie in the state pool: no gather of the rows before (`hebrus.ops.qsa.dense_attention_lanes`
is its readable twin, and the contract).

A session's rows are read in tiles of whole blocks (`TILE` rows), dealt in turn to runs, so
that a few sessions at a long context still spread over every multiprocessor and every run has
work whatever the position: one program per (session, K/V head, run) takes the group of query
heads that share the K/V head against each of its tiles up to the session's position, with a
running softmax (maximum and sum kept in float32), and leaves its partial result; a second
kernel weighs each session's runs together. A session reads its own rows and no more, whatever
the table's width. The products take their
16-bit operands as float32 (on Hopper TF32, which holds a bfloat16 or float16 value exactly) and
add in float32.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hebrus.ops.cuda.chain import after_the_last, chained


# From benchmarks/decode_kernels.py on an H200 (1.68B shape, 1K context; results/cuda-h200/
# decode-kernels-6fd5d50.txt): 64 rows, 4 warps, 2 programs per multiprocessor was the fastest or
# within 0.5 us of it at 1, 8, 64 and 256 lanes (256: 149 us against 174 us for 32 and 4).
WARPS = 4               # warps per program of the runs' kernel
SPREAD = 2              # programs per multiprocessor the runs aim for
TILE = 64               # rows a program takes at a time (whole blocks: at least one)
WEIGHED = 16            # runs the weighing takes at a time


# The runs a table is dealt to grow with its tiles (`runs_for`) and the table's width with the
# context: both are plain arguments, never specialised, so that a context no warm-up met runs the
# kernels compiled already (as constants, each new count compiled both again: 1.5 s of a server's
# step at a 2K context on an H100).
@triton.jit(do_not_specialize=["W", "RUNS"])
def _runs(q, k, v, tables, positions, acc_out, top_out, total_out, W, scale,
          k_block, k_row, k_head, v_block, v_row, v_head, RUNS,
          HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
          R: tl.constexpr, BB: tl.constexpr, RP: tl.constexpr, CHAINED: tl.constexpr):
    after_the_last(CHAINED)
    n, h, run = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    position = tl.load(positions + n)
    rg, rd, rr = tl.arange(0, GP), tl.arange(0, DP), tl.arange(0, RP)
    mg, md = rg < G, rd < D
    heads = h * G + rg
    bq = tl.load(q + (n * HQ + heads)[:, None] * D + rd[None, :], mask=mg[:, None] & md[None, :],
                 other=0.0).to(tl.float32)
    top = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    within, inner = rr // R, rr % R                     # each row's block in the tile, and row in it
    # tiles of BB blocks dealt to the runs in turn: every run has work whatever the position
    for t in range(run, position // (BB * R) + 1, RUNS):
        visible = (rr < BB * R) & (t * BB * R + rr <= position)
        block = tl.load(tables + n * W + t * BB + within, mask=visible, other=0)
        rows = visible[:, None] & md[None, :]
        bk = tl.load(k + block[:, None] * k_block + inner[:, None] * k_row + h * k_head + rd[None, :], mask=rows,
                     other=0.0).to(tl.float32)
        scores = tl.dot(bq, tl.trans(bk)) * scale                                        # [GP, RP]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        weights = tl.exp(scores - new_top[:, None])
        fade = tl.exp(top - new_top)
        total = total * fade + tl.sum(weights, 1)
        bv = tl.load(v + block[:, None] * v_block + inner[:, None] * v_row + h * v_head + rd[None, :], mask=rows,
                     other=0.0).to(tl.float32)
        acc = acc * fade[:, None] + tl.dot(weights, bv)
        top = new_top
    at = (n * HQ + heads) * RUNS + run                                                   # [GP]
    tl.store(acc_out + at[:, None] * D + rd[None, :], acc, mask=mg[:, None] & md[None, :])
    tl.store(top_out + at, top, mask=mg)
    tl.store(total_out + at, total, mask=mg)


@triton.jit(do_not_specialize=["RUNS"])
def _weigh(acc, top, total, o, gate, gate_row, RUNS, HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
           SB: tl.constexpr, GATED: tl.constexpr, CHAINED: tl.constexpr):
    """One (session, query head): its runs' partial results in the proportion of their sums
    against the largest maximum (a run that saw no row has maximum -inf and weighs nothing),
    SB runs at a time (any number of runs, one kernel); `GATED`: then, rounded to o's dtype,
    times σ(gate) (attention's output gate)."""
    after_the_last(CHAINED)
    i = tl.program_id(0)
    rs, rd = tl.arange(0, SB), tl.arange(0, DP)
    md = rd < D
    largest = tl.full([SB], float("-inf"), tl.float32)
    for first in range(0, RUNS, SB):
        largest = tl.maximum(largest, tl.load(top + i * RUNS + first + rs, mask=first + rs < RUNS,
                                              other=float("-inf")))
    biggest = tl.max(largest, 0)
    sums = tl.zeros([SB], tl.float32)
    out = tl.zeros([DP], tl.float32)
    for first in range(0, RUNS, SB):
        ms = first + rs < RUNS
        tops = tl.load(top + i * RUNS + first + rs, mask=ms, other=float("-inf"))
        scale = tl.where(ms & (tops > float("-inf")), tl.exp(tops - biggest), 0.0)
        sums += tl.load(total + i * RUNS + first + rs, mask=ms, other=0.0) * scale
        parts = tl.load(acc + (i * RUNS + first + rs)[:, None] * D + rd[None, :], mask=ms[:, None] & md[None, :],
                        other=0.0)
        out += tl.sum(parts * scale[:, None], 0)
    out = out / tl.sum(sums, 0)
    if GATED:
        g = tl.load(gate + (i // HQ) * gate_row + (i % HQ) * D + rd, mask=md, other=0.0).to(tl.float32)
        out = out.to(o.dtype.element_ty).to(tl.float32) / (1.0 + tl.exp(-g))
    tl.store(o + i * D + rd, out.to(o.dtype.element_ty), mask=md)


@functools.cache
def _processors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def runs_for(sessions: int, kv_heads: int, tiles: int, processors: int) -> int:
    """How many runs a session's table of `tiles` tiles is dealt to: enough programs to fill the
    multiprocessors `SPREAD` times over, never more runs than tiles."""
    return max(1, min(tiles, -(-SPREAD * processors // (sessions * kv_heads))))


def attention_lanes_cuda(q, k_blocks, v_blocks, tables, positions, gate=None,
                         runs: int | None = None) -> torch.Tensor:
    """q [N, Hq, dh]; k_blocks, v_blocks [B, R, Hkv, dh] (each row's heads and values dense);
    tables [N, W]; positions [N] -> o [N, Hq, dh] in q's dtype; with `gate` [N, Hq, dh], o ⊙ σ(gate)
    (in the kernel that weighs the runs). `runs`: how many runs a table is split into (default
    `runs_for` this device)."""
    N, HQ, D = q.shape
    R, HKV = k_blocks.shape[1], k_blocks.shape[2]
    G, W = HQ // HKV, tables.shape[1]
    if gate is not None:
        if gate.shape != q.shape or gate.dtype != q.dtype or gate.device != q.device:
            raise ValueError(f"the output gate must be laid as q: {tuple(gate.shape)} {gate.dtype} against "
                             f"{tuple(q.shape)} {q.dtype}")
        if gate.stride(2) != 1 or gate.stride(1) != D:
            gate = gate.contiguous()
    for blocks in (k_blocks, v_blocks):
        if blocks.stride(3) != 1 or blocks.stride(2) != D:
            raise ValueError("the lanes' attention kernel reads rows whose heads and values are dense")
    q, tables, positions = q.contiguous(), tables.contiguous(), positions.contiguous()
    BB = max(1, TILE // R)                  # blocks a tile
    tiles = -(-W // BB)
    if runs is None:
        runs = runs_for(N, HKV, tiles, _processors(q.device.index or 0))
    runs = min(max(runs, 1), tiles)
    acc = torch.empty((N, HQ, runs, D), dtype=torch.float32, device=q.device)
    top = torch.empty((N, HQ, runs), dtype=torch.float32, device=q.device)
    total = torch.empty_like(top)
    # tl.dot multiplies tiles of at least 16 along each side: the group, the rows and the values
    # are padded to that (and to a power of two), the padding masked off
    DP = max(16, triton.next_power_of_2(D))
    chain = chained(q.device)
    _runs[(N, HKV, runs)](q, k_blocks, v_blocks, tables, positions, acc, top, total, W, D ** -0.5,
                          k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
                          v_blocks.stride(0), v_blocks.stride(1), v_blocks.stride(2), runs,
                          HQ=HQ, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=DP,
                          R=R, BB=BB, RP=max(16, triton.next_power_of_2(BB * R)), num_warps=WARPS,
                          CHAINED=chain, launch_pdl=chain)
    o = torch.empty_like(q)
    _weigh[(N * HQ,)](acc, top, total, o, o if gate is None else gate, 0 if gate is None else gate.stride(0), runs,
                      HQ=HQ, D=D, DP=DP, SB=WEIGHED, GATED=gate is not None,
                      CHAINED=chain, launch_pdl=chain)
    return o


attention_lanes_cuda.reads_to_position = True      # its work ends at each lane's position, not the tables' width
