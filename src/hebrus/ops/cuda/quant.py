"""Quantized matrix products in Triton: y = x Wᵀ with W read in its stored form (int8, int4 or
fp8 codes and their scales) and rebuilt in registers, so a step reads the quantized bytes once.
The twin is `ops.quant.rebuilt_linear` (rebuild W, then F.linear); it runs whatever these
kernels do not take (a stack of experts, save through `experts`; a float32 x of more than
FEW_ROWS rows).

Two shapes of kernel:
- **vector** (a decode step's row or two: `VECTOR_ROWS`): each program reduces BLOCK_N outputs of
  one row of x over the inputs in tiles of BLOCK_K, keeping float32 partial sums per tile column
  (int8) or per group or block (int4, fp8: a group's Σ q·x is scaled once) and reducing them at
  the end. Few outputs a program and wide tiles keep many bytes in flight, as the 16-bit product
  does (`ops.cuda.gemv`): that is what a matrix-vector product's speed is made of. int4's codes
  are read as they lie, a row's nibbles contiguous: as 32-bit words where a row is whole words
  (eight codes a word, each code's float made from its bits, x read in eight strided rows), else
  as bytes (x read once a tile, split into the even and odd inputs in registers). A zero point
  comes in once a group: Σ (q − z)·x = Σ q·x − z·Σ x.
- **matrix** (more rows, 16-bit x): tiles of W rebuilt in x's dtype, exactly as the twin rebuilds
  them (int8 and fp8 codes are exact in 16 bits; int4's (q − z)·s rounded once), and multiplied
  on the tensor cores (`tl.dot`), float32 accumulation; int8's per-output scale and fp8's block
  scales applied to the float32 sums.

The vector kernels also run two other ways: GATED, for SwiGLU's gate and up laid together
([G; U]), each program reducing its outputs' gate rows and up rows and writing silu(gate) ⊙ up
(`silu_gated`; twin: the product, then `ops.moe.silu_mul`); and ROUTED, each row of x by its own
expert of a stack, the expert read first (`experts`, a decode step's few (token, choice) rows;
twin: `ops.moe.experts_gathered`).

Every kernel walks its inputs in a fixed order: the same inputs give the same bits whatever the
launch. The vector kernels (all but ROUTED ones, which read their expert first) take part in a
chained launch (`ops.cuda.chain`): their first tile of codes is read before the kernel before
them has finished (no kernel writes a weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hebrus.ops.cuda.chain import after_the_last, chained
from hebrus.ops.moe import experts_gathered, silu_mul
from hebrus.ops.quant import Quantized, rebuilt_linear

FEW_ROWS = 16          # a float32 x: rows the vector kernels take (more go to the twin)
VECTOR_ROWS = 2        # a 16-bit x: rows through the vector kernels (more: the matrix kernel)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)


@triton.jit
def _rows(H, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """A vector program's rows of W and whether each is inside: its BLOCK_N outputs' rows, or
    (GATED: W is [gate; up], H rows each) its outputs' gate rows, then their up rows H on."""
    r = tl.arange(0, 2 * BLOCK_N if GATED else BLOCK_N)
    i = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    return i + (r // BLOCK_N) * H, i < H


@triton.jit
def _store(y_ptr, m, sums, H, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Row m of y [M, H]: the program's sums, or (GATED) silu(gate) ⊙ up of them, each product
    rounded to y's dtype first as it alone writes it (the twin: the product, then
    `ops.moe.silu_mul`)."""
    out = y_ptr.dtype.element_ty
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(sums, (2, BLOCK_N)), (1, 0)))
        gate, up = gate.to(out).to(tl.float32), up.to(out).to(tl.float32)
        sums = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + m.to(tl.int64) * H + i, sums.to(out), mask=i < H)


@triton.jit
def _int8_vector(x_ptr, w_ptr, s_ptr, y_ptr, e_ptr, W_E, S_E, H, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, ROUTED: tl.constexpr, CHAINED: tl.constexpr):
    m = tl.program_id(1)
    if ROUTED:                  # row m's own expert of a stack: its codes and scales W_E and S_E apart
        e = tl.load(e_ptr + m).to(tl.int64)
        w_ptr += e * W_E
        s_ptr += e * S_E
    n, inside = _rows(H, BLOCK_N, GATED)
    row = n.to(tl.int64) * K
    k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + row[:, None] + k[None, :], mask=inside[:, None] & (k[None, :] < K), other=0)
    after_the_last(CHAINED)
    x_row = x_ptr + m.to(tl.int64) * K
    acc = w.to(tl.float32) * tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=inside[:, None] & (k[None, :] < K), other=0)
        acc += w.to(tl.float32) * tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    s = tl.load(s_ptr + n, mask=inside, other=0.0)
    _store(y_ptr, m, tl.sum(acc, axis=1) * s, H, BLOCK_N, GATED)


@triton.jit
def _int4_tile(b, x_row, s_ptr, z_ptr, n, inside, k0, K, G, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr):
    """The tile of inputs from k0: its [BLOCK_N, BLOCK_K // GROUP] scaled group sums Σ s·(q − z)·x,
    from its codes `b`: [BLOCK_N, BLOCK_K // 2] bytes, or (WORDS) [BLOCK_N, BLOCK_K // 8] 32-bit
    words. A word's eight codes are taken one at a time, each against its own strided row of x,
    its float made from its bits: (q | 2^23's bits) read as a float is 2^23 + q exactly, so a
    subtraction gives q (symmetric: q − 8, centred in the same subtraction) where converting an
    integer to a float runs at a quarter of the rate."""
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    there = inside[:, None] & (g[None, :] < G)
    s = tl.load(s_ptr + n.to(tl.int64)[:, None] * G + g[None, :], mask=there, other=0.0)
    if WORDS:
        CENTRE: tl.constexpr = 8388608.0 if HAS_ZERO else 8388616.0                      # 2^23 (+ 8)
        i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        part = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        x8 = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)        # Σ x a word's inputs: zero points only
        for t in tl.static_range(8):                            # nibble t of word i: input 8i + t
            xt = tl.load(x_row + 8 * i + t, mask=8 * i + t < K, other=0.0).to(tl.float32)
            q = (((b >> (4 * t)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - CENTRE
            part += q * xt[None, :]
            if HAS_ZERO:
                x8 += xt
        qx = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)), axis=2)
        if HAS_ZERO:
            xs = tl.sum(tl.reshape(x8, (BLOCK_K // GROUP, GROUP // 8)), axis=1)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
        b = b.to(tl.int32)
        codes = (b & 15).to(tl.float32) * even[None, :] + (b >> 4).to(tl.float32) * odd[None, :]
        qx = tl.sum(tl.reshape(codes, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), axis=2)      # Σ q·x a group
        xs = tl.sum(tl.reshape(x, (BLOCK_K // GROUP, GROUP)), axis=1)                        # Σ x a group
    if HAS_ZERO:
        z = tl.load(z_ptr + n.to(tl.int64)[:, None] * G + g[None, :], mask=there, other=0).to(tl.float32)
        return s * (qx - z * xs[None, :])
    elif WORDS:                 # centred as made
        return s * qx
    else:
        return s * (qx - 8.0 * xs[None, :])


@triton.jit
def _int4_vector(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, e_ptr, W_E, S_E, H, K, width, G, HAS_ZERO: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr,
                 ROUTED: tl.constexpr, CHAINED: tl.constexpr, WORDS: tl.constexpr):
    # w: [N, width] bytes (width = ceil(K/2)), input 2j in the low nibble of byte j; or (WORDS: a
    # row's bytes a multiple of 4) [N, width] 32-bit words, input 8i + t in nibble t of word i.
    # width is an argument, the codes' own: Triton then knows where it divides by 16 and loads
    # sixteen bytes at once (computed here, it read bytes one by one). s, z: [N, G] a GROUP of
    # inputs; BLOCK_K a multiple of GROUP: a tile holds whole groups
    m = tl.program_id(1)
    if ROUTED:                  # zero points lie as the scales do
        e = tl.load(e_ptr + m).to(tl.int64)
        w_ptr += e * W_E
        s_ptr += e * S_E
        z_ptr += e * S_E
    n, inside = _rows(H, BLOCK_N, GATED)
    ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    UNIT: tl.constexpr = 8 if WORDS else 2                      # codes an element of w
    row = n.to(tl.int64) * width
    j = tl.arange(0, BLOCK_K // UNIT)
    b = tl.load(w_ptr + row[:, None] + j[None, :], mask=inside[:, None] & (j[None, :] < width), other=0)
    after_the_last(CHAINED)
    x_row = x_ptr + m.to(tl.int64) * K
    acc = _int4_tile(b, x_row, s_ptr, z_ptr, n, inside, 0, K, G, HAS_ZERO, ROWS, BLOCK_K, GROUP, WORDS)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        j = k0 // UNIT + tl.arange(0, BLOCK_K // UNIT)
        b = tl.load(w_ptr + row[:, None] + j[None, :], mask=inside[:, None] & (j[None, :] < width), other=0)
        acc += _int4_tile(b, x_row, s_ptr, z_ptr, n, inside, k0, K, G, HAS_ZERO, ROWS, BLOCK_K, GROUP, WORDS)
    _store(y_ptr, m, tl.sum(acc, axis=1), H, BLOCK_N, GATED)


@triton.jit
def _fp8_tile(w, x_row, scales, k0, K, GK, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    """The tile of inputs from k0: its [ROWS, BLOCK_K // BLOCK] scaled block sums, from its codes
    `w` and its rows' rows of scales `scales` [ROWS]."""
    k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
    sums = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (ROWS, BLOCK_K // BLOCK, BLOCK)), axis=2)
    g = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
    return sums * tl.load(scales[:, None] + g[None, :], mask=g[None, :] < GK, other=0.0)


@triton.jit
def _fp8_vector(x_ptr, w_ptr, s_ptr, y_ptr, e_ptr, W_E, S_E, H, K, GK, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr, CHAINED: tl.constexpr):
    # s: [ceil(N/BLOCK), GK], a row of scales a block of BLOCK rows; BLOCK divides BLOCK_K (a tile
    # holds whole blocks)
    m = tl.program_id(1)
    if ROUTED:
        e = tl.load(e_ptr + m).to(tl.int64)
        w_ptr += e * W_E
        s_ptr += e * S_E
    n, inside = _rows(H, BLOCK_N, GATED)
    ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    scales = s_ptr + (tl.where(inside, n, 0) // BLOCK).to(tl.int64) * GK      # rows past the end: row 0's
    row = n.to(tl.int64) * K
    k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + row[:, None] + k[None, :], mask=inside[:, None] & (k[None, :] < K), other=0.0)
    after_the_last(CHAINED)
    x_row = x_ptr + m.to(tl.int64) * K
    acc = _fp8_tile(w, x_row, scales, 0, K, GK, ROWS, BLOCK_K, BLOCK)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=inside[:, None] & (k[None, :] < K), other=0.0)
        acc += _fp8_tile(w, x_row, scales, k0, K, GK, ROWS, BLOCK_K, BLOCK)
    _store(y_ptr, m, tl.sum(acc, axis=1), H, BLOCK_N, GATED)


@triton.jit
def _matrix(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, half, G, FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr,
            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # FORMAT 0: int8 (s [N]); 1: int4 (w [N, half] bytes, s, z [N, G], BLOCK_K divides GROUP: a tile
    # is in one group);
    # 2: fp8 (s [ceil(N/GROUP), G], BLOCK_K and BLOCK_N divide GROUP: one scale a tile)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        if FORMAT == 1:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(w_ptr + n.to(tl.int64)[None, :] * half + j[:, None], mask=(n[None, :] < N) & (j[:, None] < half),
                        other=0).to(tl.int32)
            q = tl.reshape(tl.permute(tl.join(b & 15, b >> 4), (0, 2, 1)), (BLOCK_K, BLOCK_N))   # input 2j + t
            g = k0 // GROUP
            s = tl.load(s_ptr + n.to(tl.int64) * G + g, mask=n < N, other=0.0)
            if HAS_ZERO:
                z = tl.load(z_ptr + n.to(tl.int64) * G + g, mask=n < N, other=0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(dtype)
            acc += tl.dot(x, w)
        else:
            inside = (n[None, :] < N) & (k[:, None] < K)
            if FORMAT == 0:
                w = tl.load(w_ptr + n.to(tl.int64)[None, :] * K + k[:, None], mask=inside, other=0)
                acc += tl.dot(x, w.to(dtype))
            else:
                w = tl.load(w_ptr + n.to(tl.int64)[None, :] * K + k[:, None], mask=inside, other=0.0)
                s = tl.load(s_ptr + ((tl.program_id(0) * BLOCK_N) // GROUP) * G + k0 // GROUP)
                acc += tl.dot(x, w.to(dtype)) * s
    if FORMAT == 0:
        acc = acc * tl.load(s_ptr + n, mask=n < N, other=0.0)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def takes(x: torch.Tensor, w: Quantized, inputs: int | None = None) -> bool:
    """Whether the kernels take this product: a CUDA x in a 16- or 32-bit float (a float64 model
    keeps its own precision through the twin; a float32 one of at most FEW_ROWS rows), a single
    (not stacked) weight in its stored layout, int4 groups and fp8 blocks a power of two of at
    least 16 (a tile holds whole ones). `inputs`: the width of the x the product will have, where
    x stands for its rows only (x's own width by default)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    side = w.group
    return (x.is_cuda and rows > 0 and x.dtype in FLOATS and (x.dtype in HALF or rows <= FEW_ROWS)
            and w.qweight.dim() == 2 and w.qweight.is_contiguous()
            and (x.shape[-1] if inputs is None else inputs) == w.inputs
            and (w.format == "int8" or (side >= 16 and side & (side - 1) == 0)))


def linear(x: torch.Tensor, w: Quantized) -> torch.Tensor:
    """`ops.quant.rebuilt_linear`, through the kernels where they take the product."""
    if not takes(x, w):
        return rebuilt_linear(x, w)
    return launch(x, w)


# (format, N, K, group) -> the fastest launch `benchmarks/quant_gemv.py --update` measured for that weight
# (cold, as a step reads it), on the device named (the last to write): a vector kernel's (BLOCK_N,
# BLOCK_K, warps) for one row, the matrix kernel's (BLOCK_M, BLOCK_N, BLOCK_K, warps) for 64 rows.
# The format is "int4-zp" for int4 with zero points. Other shapes take the rules below. (int8's,
# fp8's and int4's rows: an H100 at 0fd6d1c, int4's vector rows for its codes read as words, the
# matrix rows from a sweep with tiles of 16 and 32 rows and outputs; int4-zp's: an H100 at
# fce7ec1, while the int4 kernels still read their codes a byte at a time.)
MEASURED_VECTOR: dict[tuple[str, int, int, int], tuple[int, int, int]] = {   # NVIDIA H100 80GB HBM3
    ('fp8', 2048, 2048, 128): (2, 2048, 4),
    ('fp8', 2048, 6144, 128): (4, 2048, 8),
    ('fp8', 5120, 2048, 128): (4, 1024, 4),
    ('fp8', 8192, 2048, 128): (2, 2048, 4),
    ('fp8', 12288, 2048, 128): (4, 2048, 4),
    ('int4', 2048, 2048, 128): (8, 2048, 8),
    ('int4', 2048, 6144, 128): (8, 2048, 8),
    ('int4', 5120, 2048, 128): (8, 2048, 8),
    ('int4', 8192, 2048, 128): (8, 1024, 4),
    ('int4', 12288, 2048, 128): (8, 1024, 4),
    ('int4-zp', 2048, 2048, 128): (8, 2048, 4),
    ('int4-zp', 2048, 6144, 128): (8, 2048, 4),
    ('int4-zp', 5120, 2048, 128): (8, 2048, 4),
    ('int4-zp', 8192, 2048, 128): (8, 2048, 4),
    ('int4-zp', 12288, 2048, 128): (8, 2048, 4),
    ('int8', 2048, 2048, 128): (2, 1024, 4),
    ('int8', 2048, 6144, 128): (1, 1024, 4),
    ('int8', 5120, 2048, 128): (8, 512, 8),
    ('int8', 8192, 2048, 128): (8, 512, 4),
    ('int8', 12288, 2048, 128): (4, 1024, 4),
}
MEASURED_MATRIX: dict[tuple[str, int, int, int], tuple[int, int, int, int]] = {   # NVIDIA H100 80GB HBM3
    ('fp8', 2048, 2048, 128): (64, 16, 128, 4),
    ('fp8', 2048, 6144, 128): (32, 16, 128, 4),
    ('fp8', 5120, 2048, 128): (64, 32, 128, 4),
    ('fp8', 8192, 2048, 128): (64, 32, 128, 4),
    ('fp8', 12288, 2048, 128): (64, 32, 128, 4),
    ('int4', 2048, 2048, 128): (16, 32, 128, 4),
    ('int4', 2048, 6144, 128): (16, 32, 128, 4),
    ('int4', 5120, 2048, 128): (64, 32, 128, 4),
    ('int4', 8192, 2048, 128): (64, 32, 128, 4),
    ('int4', 12288, 2048, 128): (64, 32, 128, 4),
    ('int4-zp', 2048, 2048, 128): (64, 32, 128, 8),
    ('int4-zp', 2048, 6144, 128): (64, 32, 128, 8),
    ('int4-zp', 5120, 2048, 128): (64, 32, 128, 4),
    ('int4-zp', 8192, 2048, 128): (64, 32, 128, 4),
    ('int4-zp', 12288, 2048, 128): (64, 32, 64, 4),
    ('int8', 2048, 2048, 128): (16, 32, 128, 4),
    ('int8', 2048, 6144, 128): (16, 32, 128, 4),
    ('int8', 5120, 2048, 128): (64, 32, 128, 4),
    ('int8', 8192, 2048, 128): (64, 32, 128, 4),
    ('int8', 12288, 2048, 128): (64, 32, 128, 4),
}


def key(w: Quantized) -> tuple[str, int, int, int]:
    """w's row in the measured tables (a stack's: each expert's)."""
    return (w.format + ("-zp" if w.zero is not None else ""), w.qweight.shape[-2], w.inputs, w.group)


def vector_shape(w: Quantized) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of a vector kernel for w: the measured launch for its shape, else
    the launch that won most often in that measurement (H100 at fce7ec1, the 1.68B shape's five
    weights: `results/cuda-h100/fce7ec1/quant-gemv.txt`), the tile cut to the inputs and holding
    whole groups or blocks."""
    measured = MEASURED_VECTOR.get(key(w))
    if measured is not None:
        return measured
    block_n, block_k = {"int8": (4, 512), "int4": (8, 2048), "fp8": (2, 2048)}[w.format]
    block_k = min(block_k, triton.next_power_of_2(w.inputs))
    return block_n, block_k if w.format == "int8" else max(block_k, w.group), 4


def matrix_shape(rows: int, w: Quantized) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the matrix kernel for `rows` of x by w: the measured
    launch for its shape (measured at 64 rows, taken from 33), else the measurement's usual winner
    (32 outputs by 128 inputs a program, 4 warps), BLOCK_K within an int4 group, one fp8 block."""
    measured = MEASURED_MATRIX.get(key(w)) if rows > 32 else None
    if measured is not None:
        return measured
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_k = 128 if w.format == "int8" else min(128, w.group)
    return block_m, min(32, w.group) if w.format == "fp8" else 32, block_k, 4


def launch(x: torch.Tensor, w: Quantized, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [..., K] Wᵀ through the kernel for its rows and w's format (any device Triton runs on), with
    the given launch shape: a vector kernel's (BLOCK_N, BLOCK_K, warps) for up to VECTOR_ROWS rows
    of a 16-bit x or FEW_ROWS of a float32 one (`vector_shape`), else the matrix kernel's
    (BLOCK_M, BLOCK_N, BLOCK_K, warps) (`matrix_shape`)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M, N = x2.shape[0], w.qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M <= VECTOR_ROWS or x.dtype == torch.float32:
        _vector(x2, w, y, shape or vector_shape(w), gated=False)
    else:
        scale = w.scale.contiguous()
        zero = w.zero.contiguous() if w.zero is not None else scale
        block_m, block_n, block_k, warps = shape or matrix_shape(M, w)
        fmt = ("int8", "int4", "fp8").index(w.format)
        groups = 0 if w.format == "int8" else scale.shape[-1]
        _matrix[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
            x2, w.qweight, scale, zero, y, M, N, K, w.qweight.shape[-1], groups, FORMAT=fmt,
            HAS_ZERO=w.zero is not None, GROUP=w.group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps)
    return y.view(*lead, N)


def silu_gated(x: torch.Tensor, w, shape: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """silu(x Gᵀ) ⊙ x Uᵀ [..., I] for a quantized w = [G; U] [2I, K] (SwiGLU's gate and up laid
    together) in one vector kernel, with the given (BLOCK_N, BLOCK_K, warps) (default: the
    product's launch, half its outputs a program: as many rows of W), where the kernels take the
    product and x has at most VECTOR_ROWS rows of 16 bits; else None (the caller runs the product
    and `ops.moe.silu_mul`)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (not isinstance(w, Quantized) or rows > VECTOR_ROWS or x.dtype not in HALF or not takes(x, w)
            or w.qweight.shape[0] % 2):
        return None
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    H = w.qweight.shape[0] // 2
    if shape is None:
        block_n, block_k, warps = vector_shape(w)
        shape = max(1, block_n // 2), block_k, warps
    y = torch.empty((x2.shape[0], H), dtype=x.dtype, device=x.device)
    _vector(x2, w, y, shape, gated=True)
    return y.view(*lead, H)


def experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up, down,
            limit: float | None = None) -> torch.Tensor:
    """`ops.moe.experts_gathered` (its twin, which runs whatever this does not take) for stacks of
    quantized experts: each (token, choice) row multiplied by its own expert's codes where they
    lie, none rebuilt or copied: the gate and up products with SwiGLU's middle in one kernel
    (without a `limit`; with one, the products, then `silu_mul`), then the down product; the
    choices summed in rank order."""
    H = gate_up.qweight.shape[-2] // 2 if isinstance(gate_up, Quantized) else 0
    if not (_stacked(h, gate_up) and _stacked(h, down, H) and gate_up.qweight.shape[-2] % 2 == 0):
        return experts_gathered(h, weights, experts, gate_up, down, limit)
    T, k = experts.shape
    routes = experts.flatten().contiguous()
    x = h.repeat_interleave(k, dim=0).contiguous()                                       # [T*k, D]
    block_n, block_k, warps = vector_shape(gate_up)
    if limit is None:
        middle = torch.empty((T * k, H), dtype=h.dtype, device=h.device)
        _vector(x, gate_up, middle, (max(1, block_n // 2), block_k, warps), gated=True, routes=routes)
    else:
        both = torch.empty((T * k, 2 * H), dtype=h.dtype, device=h.device)
        _vector(x, gate_up, both, (block_n, block_k, warps), gated=False, routes=routes)
        middle = silu_mul(*both.chunk(2, dim=-1), limit)
    y = torch.empty((T * k, down.qweight.shape[-2]), dtype=h.dtype, device=h.device)
    _vector(middle, down, y, vector_shape(down), gated=False, routes=routes)
    y = y * weights.flatten().to(h.dtype)[:, None]
    return y.view(T, k, -1).sum(1)


def _stacked(h: torch.Tensor, w, inputs: int | None = None) -> bool:
    """Whether `experts` multiplies rows like h's, `inputs` wide (h's own width by default; the
    down product's x is SwiGLU's middle), by stack w here: a quantized stack [E, N, ...] lying
    contiguous, an expert of which the kernels take (`takes`)."""
    return (isinstance(w, Quantized) and w.qweight.dim() == 3 and w.qweight.is_contiguous()
            and w.scale.is_contiguous() and (w.zero is None or w.zero.is_contiguous())
            and takes(h, w[0], inputs))


def _vector(x2: torch.Tensor, w: Quantized, y: torch.Tensor, shape: tuple[int, int, int], gated: bool,
            routes: torch.Tensor | None = None) -> None:
    """y [M, H] from x2 [M, K] and w through w's vector kernel at `shape`: x2 Wᵀ (H rows of W),
    or silu(x2 Gᵀ) ⊙ x2 Uᵀ for w = [G; U] (2H rows); with `routes` [M] (w a contiguous stack of
    experts), each row of x2 by its own expert's weight. A routed launch is not chained: it reads
    its expert before any weight."""
    block_n, block_k, warps = shape
    (M, K), H = x2.shape, y.shape[-1]
    scale = w.scale.contiguous()
    routed = routes is not None
    chain = chained(x2.device) and not routed
    grid = (triton.cdiv(H, block_n), M)
    e, w_e, s_e = (routes, w.qweight[0].numel(), scale[0].numel()) if routed else (scale, 0, 0)
    if w.format == "int8":
        _int8_vector[grid](x2, w.qweight, scale, y, e, w_e, s_e, H, K, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
                           ROUTED=routed, CHAINED=chain, num_warps=warps, launch_pdl=chain)
    elif w.format == "int4":
        zero = w.zero.contiguous() if w.zero is not None else scale
        codes = w.qweight
        if codes.shape[-1] % 4 == 0 and codes.storage_offset() % 4 == 0 and codes.data_ptr() % 4 == 0:   # words
            codes, w_e = codes.view(torch.int32), w_e // 4
        _int4_vector[grid](x2, codes, scale, zero, y, e, w_e, s_e, H, K, codes.shape[-1], scale.shape[-1],
                           HAS_ZERO=w.zero is not None, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=w.group, GATED=gated,
                           ROUTED=routed, CHAINED=chain, WORDS=codes.dtype == torch.int32, num_warps=warps,
                           launch_pdl=chain)
    else:
        _fp8_vector[grid](x2, w.qweight, scale, y, e, w_e, s_e, H, K, scale.shape[-1], BLOCK_N=block_n,
                          BLOCK_K=block_k, BLOCK=w.group, GATED=gated, ROUTED=routed, CHAINED=chain,
                          num_warps=warps, launch_pdl=chain)
