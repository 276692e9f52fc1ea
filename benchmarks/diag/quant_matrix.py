"""Does the quantized matrix kernel lose its time to where its rebuilt tile lies? On an H100 at
fce7ec1 64 rows through it took 1,645 µs a 1.68B step (int8), 1,875 (fp8), 3,915 (int4) against
bf16 F.linear's 1,303 (results/cuda-h100/fce7ec1/quant-gemv.txt), where the int8 bytes alone are
some 460 µs at the copy bandwidth. The module's kernel multiplies x [BLOCK_M, BLOCK_K] by the
rebuilt tile of W [BLOCK_K, BLOCK_N] as the second operand, which Hopper's tensor cores read from
shared memory only: each rebuilt tile goes from registers to shared memory and back. Here the
product is turned around, y tileᵀ = W tile · x tileᵀ: the rebuilt W tile [BLOCK_N, BLOCK_K] is the
first operand (which the tensor cores may read from registers), loaded along its rows as it lies,
and x's tile, as it came, the second. int4's tile is two products, its low nibbles by x's even
inputs and its high ones by the odd (as the module's now is).

Each launch (BLOCK_N, BLOCK_K, warps, stages; 64 rows a program) is checked against the rebuilt
twin, then timed cold (`gemv.per_call` over `gemv.cold_copies`) on the 1.68B shape's quantized
weights beside the module's matrix kernel at its launch and bf16 F.linear, and a step's products
summed at each one's best.

    python benchmarks/diag/quant_matrix.py [--out DIR] [--formats int8,fp8,int4]
    (CUDA; TRITON_INTERPRET=1 on a CPU checks the kernel on small weights, in float16)"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hebrus.ops.cuda import quant  # noqa: E402
from hebrus.ops.quant import quantize, rebuilt_linear  # noqa: E402

SHAPES = ((8192, 2048, 18), (2048, 2048, 24), (5120, 2048, 6), (12288, 2048, 24), (2048, 6144, 24))
ROWS = 64
# BLOCK_N, BLOCK_K, warps, stages
LAUNCHES = list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))


@triton.jit
def _turned(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, half, G, FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr,
            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # FORMAT 0 int8 (s [N]); 1 int4 (s, z [N, G]); 2 fp8 (s [ceil(N/GROUP), G], BLOCK_N and BLOCK_K
    # dividing GROUP: one scale a tile). acc is yᵀ's tile [BLOCK_N, BLOCK_M].
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n64, m64 = n.to(tl.int64), m.to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FORMAT == 1:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(w_ptr + n64[:, None] * half + j[None, :], mask=(n[:, None] < N) & (j[None, :] < half),
                        other=0).to(tl.int32)
            x_row = x_ptr + m64[:, None] * K + 2 * j[None, :]
            rows = m[:, None] < M
            even = tl.load(x_row, mask=rows & (2 * j[None, :] < K), other=0.0)
            odd = tl.load(x_row + 1, mask=rows & (2 * j[None, :] + 1 < K), other=0.0)
            g = (2 * j) // GROUP
            there = (n[:, None] < N) & (g[None, :] < G)
            s = tl.load(s_ptr + n64[:, None] * G + g[None, :], mask=there, other=0.0)
            if HAS_ZERO:
                z = tl.load(z_ptr + n64[:, None] * G + g[None, :], mask=there, other=0).to(tl.float32)
            else:
                z = 8.0
            acc += tl.dot((((b & 15).to(tl.float32) - z) * s).to(dtype), tl.trans(even))
            acc += tl.dot((((b >> 4).to(tl.float32) - z) * s).to(dtype), tl.trans(odd))
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m64[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            inside = (n[:, None] < N) & (k[None, :] < K)
            if FORMAT == 0:
                w = tl.load(w_ptr + n64[:, None] * K + k[None, :], mask=inside, other=0)
                acc += tl.dot(w.to(dtype), tl.trans(x))
            else:
                w = tl.load(w_ptr + n64[:, None] * K + k[None, :], mask=inside, other=0.0)
                s = tl.load(s_ptr + ((tl.program_id(0) * BLOCK_N) // GROUP) * G + k0 // GROUP)
                acc += tl.dot(w.to(dtype), tl.trans(x)) * s
    if FORMAT == 0:
        acc = acc * tl.load(s_ptr + n, mask=n < N, other=0.0)[:, None]
    tl.store(y_ptr + m64[None, :] * N + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(m[None, :] < M) & (n[:, None] < N))


def turned(x: torch.Tensor, w, launch: tuple[int, int, int, int]) -> torch.Tensor:
    """x [M, K] Wᵀ through `_turned` at (BLOCK_N, BLOCK_K, warps, stages), 64 rows a program."""
    block_n, block_k, warps, stages = launch
    (M, K), N = x.shape, w.qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    zero = w.zero if w.zero is not None else w.scale
    fmt = ("int8", "int4", "fp8").index(w.format)
    groups = 0 if w.format == "int8" else w.scale.shape[-1]
    _turned[(triton.cdiv(N, block_n), triton.cdiv(M, ROWS))](
        x, w.qweight, w.scale, zero, y, M, N, K, w.qweight.shape[-1], groups, FORMAT=fmt, HAS_ZERO=w.zero is not None,
        GROUP=w.group,
        BLOCK_M=ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def scaled_mm(x: torch.Tensor, w) -> float:
    """Seconds a call of the tensor cores' fp8 product takes for x by w's codes (x made fp8 a row
    at a time first, as a W8A8 product would; one scale a row of W): a bound on what fp8 at many
    rows could reach through it, not the module's numerics (x is not rounded to fp8 there)."""
    from gemv import cold_copies, per_call
    scale_x = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
    xq = (x.float() / scale_x).to(torch.float8_e4m3fn)
    scale_w = torch.ones(1, w.qweight.shape[0], device=x.device)
    try:
        return per_call(lambda q: torch._scaled_mm(xq, q.t(), scale_a=scale_x, scale_b=scale_w,
                                                   out_dtype=x.dtype), cold_copies(w.qweight))
    except RuntimeError as exc:
        print(f"  _scaled_mm: {str(exc).splitlines()[0][:200]}", flush=True)
        return float("nan")


def fits(w, launch) -> bool:
    block_n, block_k, _, _ = launch
    return w.format != "fp8" or (w.group % block_n == 0 and w.group % block_k == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--formats", default="int8,fp8,int4")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    lines, total = [], {}
    for fmt in args.formats.split(","):
        shapes = SHAPES if cuda else ((130, 384, 1), (256, 301, 1))
        launches = LAUNCHES if cuda else [(64, 64, 4, 3), (128, 128, 4, 3)]
        for N, K, count in shapes:
            if not cuda and fmt == "fp8" and K % 128:
                continue
            w = quantize(torch.randn(N, K, device=device, generator=g), fmt.removesuffix("-zp"),
                         zero_point=fmt.endswith("-zp"))
            x = torch.randn(ROWS if cuda else 70, K, device=device, generator=g).to(dtype)
            want = rebuilt_linear(x.float(), w)
            times = {}
            for launch in (launch for launch in launches if fits(w, launch)):
                error = float((turned(x, w, launch).float() - want).abs().max() / want.abs().max())
                assert error < 1e-2, (fmt, N, K, launch, error)
                if cuda:
                    from gemv import cold_copies, per_call
                    times[launch] = per_call(lambda w: turned(x, w, launch), cold_copies(w))
            if not cuda:
                lines.append(f"{fmt} {N} x {K}: every launch within 1e-2 of the twin")
                print(lines[-1], flush=True)
                continue
            from gemv import cold_copies, per_call
            module = per_call(lambda w: quant.launch(x, w), cold_copies(w))
            dense = per_call(lambda w: F.linear(x, w), cold_copies(w.dequantize(dtype)))
            best = min(times, key=times.get)
            if fmt == "fp8":
                scaled = scaled_mm(x, w)
                total[fmt, "fp8 _scaled_mm"] = total.get((fmt, "fp8 _scaled_mm"), 0.0) + count * scaled
                print(f"  fp8 torch._scaled_mm (x rowwise to fp8, one scale a row of W): {scaled * 1e6:.1f} µs",
                      flush=True)
            for name, t in (("module", module), ("turned", times[best]), ("bf16 F.linear", dense)):
                total[fmt, name] = total.get((fmt, name), 0.0) + count * t
            lines.append(f"{fmt} {N} x {K} ({count} a step), {ROWS} rows: module {module * 1e6:.1f} µs at "
                         f"{quant.matrix_shape(ROWS, w)}; turned best {times[best] * 1e6:.1f} µs at {best}; bf16 "
                         f"{dense * 1e6:.1f} µs; " + ", ".join(f"{k} {t * 1e6:.1f}" for k, t in sorted(times.items())))
            print(lines[-1], flush=True)
    for fmt in args.formats.split(","):
        if (fmt, "module") in total:
            lines.append(f"a step's {fmt} products at {ROWS} rows: " + ", ".join(
                f"{name} {total[fmt, name] * 1e6:.0f} µs" for name in ("module", "turned", "bf16 F.linear",
                                                                         "fp8 _scaled_mm") if (fmt, name) in total))
            print(lines[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quant-matrix.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
