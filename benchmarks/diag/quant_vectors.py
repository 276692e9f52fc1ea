"""Are the quantized vector kernels bound by their float32 partial sums? On an H100 at 88910d2 a
1.68B decode step's int8 products read their bytes at 54% of the copy bandwidth and int4's at
21-25%, where the 16-bit kernel reads at 75-81% (results/cuda-h100/88910d2/); making the codes'
floats from their bits changed nothing for either (int4-bits.txt, results/cuda-h100/6621730/
int8-bits.txt). The module's kernels keep a [BLOCK_N, BLOCK_K] float32 sum a tile (int8), or sum
a tile's groups through a reshape (int4): twice the registers the 16-bit kernel keeps for the
same bytes, or a shuffle of lanes a tile.

Here each thread's sixteen bytes stay its own: a tile is [BLOCK_N, BLOCK_K / 16, 16] bytes,
each 16 summed in the thread that loaded them (one 128-bit load, sixteen multiplies, no lane
crossed), a float32 partial sum per sixteen bytes kept across tiles and reduced once at the end.
int4's scale (and zero point) applies per sixteen bytes (32 codes, within one group), its codes
from their bits. Each variant is checked against the rebuilt twin, then timed cold (`gemv.per_call`
over `gemv.cold_copies`) on the 1.68B shape's quantized weights at every launch of LAUNCHES,
beside the module at its measured launch; a step's products summed at each kernel's best. int4 also
with x read in pairs and split in registers (launches marked "pairs").

    python benchmarks/diag/quant_vectors.py [--out DIR] [--formats int8,int4]
    (CUDA; TRITON_INTERPRET=1 on a CPU checks the kernels on small weights)"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hebrus.ops.cuda import quant  # noqa: E402
from hebrus.ops.quant import quantize, rebuilt_linear  # noqa: E402

# (outputs, inputs, products a step): the 1.68B shape's quantized weights as a step multiplies them
SHAPES = ((8192, 2048, 18), (2048, 2048, 24), (5120, 2048, 6), (12288, 2048, 24), (2048, 6144, 24))
VEC = 16                        # bytes a thread loads and sums alone
# BLOCK_N, BLOCK_K (bytes of a row a tile), warps
LAUNCHES = [(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096), (4, 8))
            if n * k <= 16384 and (w == 4 or n * k >= 8192)]


@triton.jit
def _int8_rows(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n3 = n.to(tl.int64)[:, None, None]
    k2 = (tl.arange(0, BLOCK_K // VEC) * VEC)[:, None] + tl.arange(0, VEC)[None, :]     # [vectors, VEC]
    acc = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + k2
        w = tl.load(w_ptr + n3 * K + k[None, :, :], mask=(n3 < N) & (k[None, :, :] < K), other=0)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)
    s = tl.load(s_ptr + n, mask=n < N, other=0.0)
    tl.store(y_ptr + n, (tl.sum(acc, axis=1) * s).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _int4_rows(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, half, G, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, VEC: tl.constexpr, GROUP: tl.constexpr, PAIRS: tl.constexpr):
    # w [N, ceil(K/2)] bytes, input 2j in byte j's low nibble; BLOCK_K bytes a tile; a vector's 2 VEC
    # codes lie in one group (GROUP a multiple of 2 VEC). PAIRS: x's inputs read as they lie, in
    # pairs (2j, 2j + 1) split in registers, rather than the even and the odd ones read apart
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = n.to(tl.int64)
    c = tl.arange(0, BLOCK_K // VEC)
    j2 = (c * VEC)[:, None] + tl.arange(0, VEC)[None, :]                                   # [vectors, VEC]
    acc = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    for j0 in range(0, half, BLOCK_K):
        j = j0 + j2
        b = tl.load(w_ptr + n64[:, None, None] * half + j[None, :, :],
                    mask=(n[:, None, None] < N) & (j[None, :, :] < half), other=0).to(tl.int32)
        if PAIRS:
            i = 2 * j[:, :, None] + tl.arange(0, 2)[None, None, :]
            even, odd = tl.split(tl.load(x_ptr + i, mask=i < K, other=0.0).to(tl.float32))
        else:
            even = tl.load(x_ptr + 2 * j, mask=2 * j < K, other=0.0).to(tl.float32)
            odd = tl.load(x_ptr + 2 * j + 1, mask=2 * j + 1 < K, other=0.0).to(tl.float32)
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0           # the codes, from bits
        hi = (((b >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        qx = tl.sum(lo * even[None, :, :] + hi * odd[None, :, :], axis=2)               # Σ q·x a vector
        g = (j0 + c * VEC) * 2 // GROUP
        there = (n[:, None] < N) & (g[None, :] < G)
        s = tl.load(s_ptr + n64[:, None] * G + g[None, :], mask=there, other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + n64[:, None] * G + g[None, :], mask=there, other=0).to(tl.float32)
        else:
            z = 8.0
        xs = tl.sum(even + odd, axis=1)                                                  # Σ x a vector
        acc += s * (qx - z * xs[None, :])
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def rows(x: torch.Tensor, w, launch: tuple[int, int, int], pairs: bool = False) -> torch.Tensor:
    """One row x [1, K] by w (int8, or int4 with groups of at least 2 VEC codes) at (BLOCK_N,
    BLOCK_K bytes, warps); int4 with `pairs`: x read in pairs."""
    block_n, block_k, warps = launch
    N, K = w.qweight.shape[0], w.inputs
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n),)
    if w.format == "int8":
        _int8_rows[grid](x, w.qweight, w.scale, y, N, K, BLOCK_N=block_n, BLOCK_K=block_k, VEC=VEC, num_warps=warps)
    else:
        zero = w.zero if w.zero is not None else w.scale
        _int4_rows[grid](x, w.qweight, w.scale, zero, y, N, K, w.qweight.shape[-1], w.scale.shape[-1],
                         HAS_ZERO=w.zero is not None, BLOCK_N=block_n, BLOCK_K=block_k, VEC=VEC, GROUP=w.group,
                         PAIRS=pairs, num_warps=warps)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--formats", default="int8,int4")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    lines = []
    for fmt in args.formats.split(","):
        zero_point = fmt.endswith("-zp")
        module_total, best_total = 0.0, 0.0
        shapes = SHAPES if cuda else ((70, 300, 1), (64, 1024, 1))
        launches = LAUNCHES if cuda else [(2, 512, 4), (4, 1024, 4)]
        for N, K, count in shapes:
            w = quantize(torch.randn(N, K, device=device, generator=g), fmt.removesuffix("-zp"), zero_point=zero_point)
            x = torch.randn(1, K, device=device, generator=g).to(torch.bfloat16 if cuda else torch.float32)
            want = rebuilt_linear(x.float(), w)
            line = [f"{fmt} {N} x {K} ({count} a step):"]
            times = {}
            for launch, pairs in [(launch, pairs) for pairs in ((False, True) if fmt.startswith("int4") else (False,))
                                  for launch in launches]:
                error = float((rows(x, w, launch, pairs).float() - want).abs().max() / want.abs().max())
                assert error < (1e-2 if cuda else 1e-5), (fmt, N, K, launch, pairs, error)
                if cuda:
                    from gemv import cold_copies, per_call
                    times[launch + (("pairs",) if pairs else ())] = per_call(lambda w: rows(x, w, launch, pairs),
                                                                             cold_copies(w))
            if not cuda:
                lines.append(" ".join(line + [f"every launch within {1e-5} of the twin"]))
                print(lines[-1], flush=True)
                continue
            from gemv import cold_copies, per_call
            shape = quant.vector_shape(w)
            module = per_call(lambda w: quant.launch(x, w, shape), cold_copies(w))
            best = min(times, key=times.get)
            module_total += count * module
            best_total += count * times[best]
            line.append(f"module {module * 1e6:.1f} µs at {shape}; own sums best {times[best] * 1e6:.1f} µs at {best}; "
                        + ", ".join(f"{launch} {t * 1e6:.1f}" for launch, t in sorted(times.items(), key=str)))
            lines.append(" ".join(line))
            print(lines[-1], flush=True)
        if cuda:
            lines.append(f"a step's {fmt} products: module {module_total * 1e6:.0f} µs, own sums at the best launch "
                         f"each {best_total * 1e6:.0f} µs")
            print(lines[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quant-vectors.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
