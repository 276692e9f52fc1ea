"""Is the int4 vector product bound by turning nibbles into floats? On an H100 at fce7ec1 it read
its bytes at 21% of the copy bandwidth where fp8 read at 84% (results/cuda-h100/fce7ec1/
quant-gemv.txt): each byte's two codes go through an integer-to-float conversion, a slow
instruction. Here the module's kernel (`ops.cuda.quant`, symmetric int4) beside variants that
make a code's float from its bits instead: (c | 0x4B000000) read as a float is 2^23 + c exactly,
so one OR and one subtraction give c; the high nibble is masked in place (16·c, its x taken
/16, exact), never shifted. Variants: x split into even and odd inputs in registers as the
module does ("bits"), or read as two strided rows ("bits, strided x"). Each checked against the
rebuilt twin, then timed cold on the 1.68B shape's weights at the module's measured launch.
"grouped": a tile kept as [outputs, groups, bytes], each code scaled where it lies and summed once
at the end (no reshape), at the module's launch and at four others. "words": the codes read as
32-bit words, eight a word, x as it lies, each code centred as its float is made (K a multiple of
8), at the module's launch and at five others.

int8 (--format int8): the module's kernel beside one whose codes' floats come from their bits
(the low byte of 2^23's bits holds c + 128), at six launches.

Measured at 88910d2 (int4: no faster) while the int4 kernels here and in the module read their
codes a byte at a time (a row's byte count computed in the kernel); it is an argument in the
module since 598b8b1 and in these kernels since ea42b42, so the question is open again.

    python benchmarks/diag/int4_bits.py [--out DIR] [--format int4|int8]       (CUDA; or TRITON_INTERPRET=1 on a CPU to check)"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hebrus.ops.cuda import quant  # noqa: E402
from hebrus.ops.quant import quantize, rebuilt_linear  # noqa: E402

SHAPES = ((8192, 2048, 18), (2048, 2048, 24), (5120, 2048, 6), (12288, 2048, 24), (2048, 6144, 24))
MAGIC = 0x4B000000          # the bits of 2^23 in float32


@triton.jit
def _bits_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, half, G, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, STRIDED: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = n.to(tl.int64) * half
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + row[:, None] + j[None, :], mask=(n[:, None] < N) & (j[None, :] < half), other=0)
        b = b.to(tl.int32)
        if STRIDED:
            even = tl.load(x_ptr + 2 * j, mask=2 * j < K, other=0.0).to(tl.float32)
            odd = tl.load(x_ptr + 2 * j + 1, mask=2 * j + 1 < K, other=0.0).to(tl.float32)
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            even, odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((b & 240) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0        # 16 c
        codes = lo * even[None, :] + hi * (odd * 0.0625)[None, :]
        qx = tl.sum(tl.reshape(codes, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), axis=2)
        xs = tl.sum(tl.reshape(x, (BLOCK_K // GROUP, GROUP)), axis=1)
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(s_ptr + n.to(tl.int64)[:, None] * G + g[None, :], mask=(n[:, None] < N) & (g[None, :] < G),
                    other=0.0)
        acc += s * (qx - 8.0 * xs[None, :])
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, half, G, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP: tl.constexpr):
    """A tile as [outputs, groups, a group's bytes]: codes from their bits, scaled where they lie
    (a group's scale broadcast along its bytes), summed once at the end: no reshape, no
    conversion of an integer to a float."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n.to(tl.int64)[:, None, None]
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP, GROUP // 2), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        j = (g * (GROUP // 2))[:, None] + tl.arange(0, GROUP // 2)[None, :]          # [groups, bytes]
        b = tl.load(w_ptr + n3 * half + j[None, :, :], mask=(n3 < N) & (j[None, :, :] < half), other=0)
        b = b.to(tl.int32)
        even = tl.load(x_ptr + 2 * j, mask=2 * j < K, other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + 2 * j + 1, mask=2 * j + 1 < K, other=0.0).to(tl.float32)
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0          # c - 8
        hi = (((b >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        s = tl.load(s_ptr + n3 * G + g[None, :, None], mask=(n3 < N) & (g[None, :, None] < G), other=0.0)
        acc += s * (lo * even[None, :, :] + hi * odd[None, :, :])
    tl.store(y_ptr + n, tl.sum(tl.sum(acc, axis=2), axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def grouped(x: torch.Tensor, w, shape) -> torch.Tensor:
    block_n, block_k, warps = shape
    N, K = w.qweight.shape[0], w.inputs
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _grouped_kernel[(triton.cdiv(N, block_n),)](x, w.qweight, w.scale, y, N, K, w.qweight.shape[-1], w.scale.shape[-1],
                                                BLOCK_N=block_n, BLOCK_K=max(block_k, w.group), GROUP=w.group,
                                                num_warps=warps)
    return y


@triton.jit
def _int8_bits_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The module's int8 vector kernel with each code's float made from its bits: (c + 128) as
    the low byte of 2^23's bits is 2^23 + c + 128 exactly, so one logic op and one subtraction
    give c, where a conversion of an integer to a float runs at a quarter of the rate."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = n.to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0)
        c = (((w.to(tl.int32) & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        acc += c * tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    s = tl.load(s_ptr + n, mask=n < N, other=0.0)
    tl.store(y_ptr + n, (tl.sum(acc, axis=1) * s).to(y_ptr.dtype.element_ty), mask=n < N)


def int8_bits(x: torch.Tensor, w, shape) -> torch.Tensor:
    block_n, block_k, warps = shape
    N, K = w.qweight.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _int8_bits_kernel[(triton.cdiv(N, block_n),)](x, w.qweight, w.scale, y, N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                                                  num_warps=warps)
    return y


@triton.jit
def _words_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, words, G, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP: tl.constexpr, UNROLLED: tl.constexpr):
    """Codes read as 32-bit words (`words` a row: a row's bytes a multiple of 4), eight codes a
    word: nibble t of word i holds input 8i + t, so x is read as it lies, no even and odd split.
    A code's float comes from its bits, centred in the same subtraction: (c | 2^23's bits) read as
    a float, less 2^23 + 8, is c - 8 exactly; per code a shift, one logic op, a subtraction and a
    multiply-add (sm_90 SASS of the module's kernel: ~6 instructions and an integer-to-float
    conversion at a quarter of the rate). A group's Σ (c - 8)·x is scaled once. UNROLLED: the
    eight codes of a word taken one at a time against their own strided row of x, so a word's
    sums stay in the thread that loaded it."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = n.to(tl.int64) * words
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        b = tl.load(w_ptr + row[:, None] + i[None, :], mask=(n[:, None] < N) & (i[None, :] < words), other=0)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.reshape(tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32), (BLOCK_K // 8, 8))
        if UNROLLED:            # a word's eight codes each against its own strided row of x, in the thread
            part = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
            for t in tl.static_range(8):
                xt = tl.load(x_ptr + 8 * i + t, mask=8 * i + t < K, other=0.0).to(tl.float32)
                q = (((b >> (4 * t)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                part += q * xt[None, :]
            qx = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)), axis=2)
        else:
            c = ((b[:, :, None] >> shifts[None, None, :]) & 15) | 0x4B000000
            q = c.to(tl.float32, bitcast=True) - 8388616.0                                # c - 8
            qx = tl.sum(tl.reshape(tl.sum(q * x[None, :, :], axis=2), (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)),
                        axis=2)
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(s_ptr + n.to(tl.int64)[:, None] * G + g[None, :], mask=(n[:, None] < N) & (g[None, :] < G),
                    other=0.0)
        acc += s * qx
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def words(x: torch.Tensor, w, shape, unrolled: bool = False) -> torch.Tensor:
    """One row x [1, K] by a symmetric int4 w whose rows are whole 32-bit words (K a multiple of
    8), at (BLOCK_N, BLOCK_K, warps)."""
    block_n, block_k, warps = shape
    N, K = w.qweight.shape[0], w.inputs
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _words_kernel[(triton.cdiv(N, block_n),)](x, w.qweight.view(torch.int32), w.scale, y, N, K, K // 8,
                                              w.scale.shape[-1], BLOCK_N=block_n, BLOCK_K=max(block_k, w.group),
                                              GROUP=w.group, UNROLLED=unrolled, num_warps=warps)
    return y


def bits(x: torch.Tensor, w, strided: bool, shape) -> torch.Tensor:
    """One row x [1, K] by a symmetric int4 w, at (BLOCK_N, BLOCK_K, warps)."""
    block_n, block_k, warps = shape
    N, K = w.qweight.shape[0], w.inputs
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _bits_kernel[(triton.cdiv(N, block_n),)](x, w.qweight, w.scale, y, N, K, w.qweight.shape[-1], w.scale.shape[-1],
                                             BLOCK_N=block_n, BLOCK_K=block_k, GROUP=w.group, STRIDED=strided,
                                             num_warps=warps)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--format", default="int4", choices=("int4", "int8"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    lines, total = [], {}
    for N, K, count in (SHAPES if cuda else ((70, 300, 1), (64, 1024, 1), (37, 2048, 1))):
        w = quantize(torch.randn(N, K, device=device, generator=g), args.format)
        x = torch.randn(1, K, device=device, generator=g).to(torch.bfloat16 if cuda else torch.float32)
        want = rebuilt_linear(x.float(), w)
        shape = quant.vector_shape(w)
        variants = {"module": lambda x, w: quant.launch(x, w, shape)}
        if args.format == "int8":
            variants["bits at the module's launch"] = lambda x, w: int8_bits(x, w, shape)
            for other in ((4, 512, 4), (8, 512, 4), (4, 1024, 4), (2, 2048, 4), (8, 1024, 8)):
                variants[f"bits {other}"] = lambda x, w, other=other: int8_bits(x, w, other)
        else:
            variants |= {"bits": lambda x, w: bits(x, w, False, shape),
                         "bits, strided x": lambda x, w: bits(x, w, True, shape)}
            variants["grouped at the module's launch"] = lambda x, w: grouped(x, w, shape)
            if K % 8 == 0:
                for other in (shape, (4, 1024, 4), (8, 1024, 4), (4, 2048, 4), (16, 512, 4), (8, 2048, 8)):
                    variants[f"words {other}"] = lambda x, w, other=other: words(x, w, other)
                    variants[f"words unrolled {other}"] = lambda x, w, other=other: words(x, w, other, True)
            for other in ((4, 1024, 4), (8, 1024, 4), (16, 512, 4), (4, 2048, 8)):
                variants[f"grouped {other}"] = lambda x, w, other=other: grouped(x, w, other)
        line = [f"{N} x {K} ({count} a step), launch {shape}:"]
        for name, run in variants.items():
            error = float((run(x, w).float() - want).abs().max() / want.abs().max())
            if not cuda:
                line.append(f"{name} error {error:.1e}")
                continue
            from gemv import cold_copies, per_call
            t = per_call(lambda w: run(x, w), cold_copies(w))
            total[name] = total.get(name, 0.0) + count * t
            line.append(f"{name} {t * 1e6:.1f} µs (error {error:.1e})")
        lines.append(" ".join(line))
        print(lines[-1], flush=True)
    if total:
        lines.append(f"a step's {args.format} products: " + ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in total.items()))
        print(lines[-1])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.format}-bits.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
