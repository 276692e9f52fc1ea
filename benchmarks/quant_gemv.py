"""The quantized products (`hebrus.ops.cuda.quant`) against the 16-bit ones and the bytes they
read, on a GPU, on the 1.68B Qwen3.5 shape's quantized weights as a step multiplies them (laid
side by side: the GDN's q/k/v and z, attention's q+gate, k and v, the MLP's gate and up). The
measurement the kernels' launch tables come from.

For each format and weight: one bf16 row through the vector kernel at every launch of CONFIGS
(each checked against the rebuilt twin first), beside the 16-bit product of the same shape
(`ops.cuda.gemv` at its launch) and, with --old FILE, the kernel module as it was (its own
`launch` at its defaults); then 64 rows through the matrix kernel at every launch of MATRIX,
beside bf16 F.linear, the rebuilt twin and, with --old, the module as it was. Each timed as
50 calls captured in one CUDA graph taking copies of the weight in turn (none read from the
cache: `gemv.cold_copies`), replayed: µs a call and the share of the copy bandwidth its bytes
are; a decode step's products summed.

`--update` writes each weight's fastest launches into the module's MEASURED_VECTOR and
MEASURED_MATRIX tables (the source file of this checkout), which its launch rules read first.

    python benchmarks/quant_gemv.py [--out DIR] [--formats int8,int4,int4-zp,fp8] [--old FILE] [--update]"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from gemv import cold_copies, per_call
from hebrus.ops.cuda import gemv
from hebrus.ops.cuda import quant
from hebrus.ops.quant import quantize, rebuilt_linear

# (outputs, inputs, products a step): GDN q/k/v + z, GDN and attention out, attention q+gate/k/v,
# MLP gate + up, MLP down (the head stays in the model's dtype)
SHAPES = ((8192, 2048, 18), (2048, 2048, 24), (5120, 2048, 6), (12288, 2048, 24), (2048, 6144, 24))
# vector: BLOCK_N, BLOCK_K, warps (a program's tile at most 8K inputs, 16K for int4's half bytes)
CONFIGS = [(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096, 8192), (4, 8))
           if n * k <= 8192 or (n * k <= 16384 and k >= 1024)]
# matrix, 64 rows: BLOCK_M, BLOCK_N, BLOCK_K, warps. Narrow tiles make more programs (a 2,048-output
# weight in tiles of 64 x 32 is 64 programs for 132 multiprocessors; 32 outputs won every weight
# at fce7ec1 and 1299bcb, the narrowest tried), each reading its W tile again from L2 per tile of rows
MATRIX = [(m, n, k, 4) for m, n, k in itertools.product((16, 32, 64), (16, 32, 64), (64, 128))] + [(64, 32, 128, 8)]
MODULE = Path(quant.__file__)


def fits(fmt: str, group: int, shape: tuple, vector: bool) -> bool:
    """Whether a launch suits the format's layout (`ops.cuda.quant`'s kernels' conditions)."""
    if vector:
        n, k, _ = shape
        return fmt == "int8" and n * k <= 8192 or fmt != "int8" and k % group == 0 and (
            fmt.startswith("int4") or (group % n == 0 and n * k <= 8192))
    _, n, k, _ = shape
    if fmt.startswith("int4"):
        return k >= 32                  # two products of k / 2 inputs, a tile across groups as it falls
    return fmt == "int8" or (group % k == 0 and group % n == 0)


def sweep(x: torch.Tensor, q, shapes: list, copies: list, name: str, lines: list, replays: int) -> list:
    """[(seconds a call, shape)] of x Wᵀ through `quant.launch` at each launch shape, fastest first:
    each checked against the rebuilt twin first (a launch this Triton cannot build, or whose
    result is wrong, is said in `lines` and skipped)."""
    want, timed = rebuilt_linear(x.float(), q), []
    for shape in shapes:
        try:
            got = quant.launch(x, q, shape)
        except Exception as exc:
            lines.append(f"{name} {shape}: FAILED, {type(exc).__name__}: {str(exc)[:100]}")
            continue
        error = float((got.float() - want).norm() / want.norm())
        if error > 1e-2:
            lines.append(f"{name} {shape}: WRONG, relative error {error:.2e}")
            continue
        timed.append((per_call(lambda q: quant.launch(x, q, shape), copies, replays=replays), shape))
    return sorted(timed)


def main() -> None:
    from hebrus.bench.limits import copy_bandwidth
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--formats", default="int8,int4,int4-zp,fp8")
    parser.add_argument("--old", help="the kernel module as it was (a .py file), timed at its own launch")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--update", action="store_true", help=f"write the fastest launches into {MODULE}")
    args = parser.parse_args()
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_quant", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    bandwidth = copy_bandwidth(torch.device("cuda"), 2**30)
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; µs a call (50 a graph, cold weights), share of it"]
    g = torch.Generator(device="cuda").manual_seed(0)
    vector, matrix = {}, {}
    step = {}

    def add(name: str, count: int, t: float) -> None:
        step[name] = step.get(name, 0.0) + count * t

    for N, K, count in SHAPES:
        w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
        x1 = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        x64 = torch.randn(64, K, device="cuda", generator=g).bfloat16()
        wb = cold_copies(w.bfloat16())
        t = per_call(lambda w: gemv.launch(x1, w), wb, replays=args.replays)
        add("bf16 one row (gemv)", count, t)
        t64 = per_call(lambda w: F.linear(x64, w), wb, replays=args.replays)
        add("bf16 64 rows (F.linear)", count, t64)
        lines.append(f"\n## {N} x {K} ({count} a step)\nbf16 one row: {t * 1e6:.1f} µs, {N * K * 2 / t / bandwidth:.0%}; "
                     f"64 rows F.linear: {t64 * 1e6:.1f} µs")
        del wb
        for fmt in args.formats.split(","):
            q = quantize(w, "int4" if fmt.startswith("int4") else fmt, zero_point=fmt == "int4-zp")
            copies = cold_copies(q)
            timed = sweep(x1, q, [c for c in CONFIGS if fits(fmt, q.group, c, True)], copies, f"{fmt} one row",
                          lines, args.replays)
            rule = quant.vector_shape(q)          # the launch the module takes (its table's, else its rule)
            at_rule = next((t for t, s in timed if s == rule), float("nan"))
            best_t, best = timed[0]
            vector[quant.key(q)] = best
            add(f"{fmt} one row, fastest", count, best_t)
            add(f"{fmt} one row, the module's launch", count, at_rule)
            lines.append(f"{fmt} one row: fastest {best} {best_t * 1e6:.1f} µs, {q.nbytes / best_t / bandwidth:.0%} "
                         f"({q.nbytes:,} bytes); the module's launch {rule} {at_rule * 1e6:.1f} µs; next: "
                         + ", ".join(f"{s} {t * 1e6:.1f}" for t, s in timed[1:4]))
            if old is not None and old.takes(x1, q):
                t = per_call(lambda q: old.launch(x1, q), copies, replays=args.replays)
                add(f"{fmt} one row, before", count, t)
                lines.append(f"{fmt} one row, before: {t * 1e6:.1f} µs, {q.nbytes / t / bandwidth:.0%}")
            t = per_call(lambda q: rebuilt_linear(x64, q), copies[:2], calls=10, replays=5)
            add(f"{fmt} 64 rows, rebuilt", count, t)
            timed = sweep(x64, q, [c for c in MATRIX if fits(fmt, q.group, c, False)], copies, f"{fmt} 64 rows",
                          lines, args.replays)
            best_t, best = timed[0]
            matrix[quant.key(q)] = best
            add(f"{fmt} 64 rows, fastest", count, best_t)
            lines.append(f"{fmt} 64 rows: rebuilt {t * 1e6:.1f} µs; matrix kernel fastest {best} {best_t * 1e6:.1f} µs "
                         f"({t64 / best_t:.2f}x bf16)")
            if old is not None and old.takes(x64, q):
                t = per_call(lambda q: old.launch(x64, q), copies, replays=args.replays)
                add(f"{fmt} 64 rows, before", count, t)
                lines.append(f"{fmt} 64 rows, before: {t * 1e6:.1f} µs")
            print("\n".join(lines[-3:]), flush=True)
            del copies
    lines.append("\n## a decode step's quantized products (the head not counted)")
    lines += [f"{name}: {t * 1e6:.0f} µs" for name, t in step.items()]
    print("\n".join(lines[-len(step) - 1:]))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quant-gemv.txt").write_text("\n".join(lines) + "\n")
    if args.update:
        update(vector, matrix, torch.cuda.get_device_name())
        print(f"wrote {len(vector)} vector and {len(matrix)} matrix launches into {MODULE}")


def update(vector: dict, matrix: dict, device: str) -> None:
    """Rewrite the kernel module's MEASURED_VECTOR and MEASURED_MATRIX tables: these rows
    replaced, the others kept."""
    text = MODULE.read_text()
    for name, rows, old in (("MEASURED_VECTOR", vector, quant.MEASURED_VECTOR),
                            ("MEASURED_MATRIX", matrix, quant.MEASURED_MATRIX)):
        table = {**old, **rows}
        begin = text.index(f"{name}: dict[")
        head_end = text.index("{", text.index("] =", begin))
        end = text.index("\n}\n", begin) + 3
        body = "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(table.items()))
        text = text[:begin] + text[begin:head_end] + "{   # " + device + "\n" + body + "}\n" + text[end:]
    MODULE.write_text(text)


if __name__ == "__main__":
    main()
