"""The batch-1 product kernel (`hebrus.ops.cuda.gemv`) against cuBLAS (F.linear), every launch
shape of it, on the 1.68B Qwen3.5 shape's weights: the measurement its `launch_shape` rule comes
from. At c7ec42d a 1.68B decode step spent 1.17 ms in its products against a ~0.75 ms weight
floor, and F.linear of one row read 6144 x 2048 at ~71-75% of the copy bandwidth
(results/cuda-h200/quant-gemv-h200.txt); at 35fd8b0 the best launch per shape took a step's
products from 1,032 to 833 µs (results/cuda-h200/gemv-35fd8b0.txt).

For each of the shape's products (and its tied head), every launch shape is checked against
F.linear in float32 (relative error) and timed as 50 calls captured in one CUDA graph, taking
copies of the weight in turn so that none is read from the cache (`cold_copies`), replayed: µs
per call and the share of the copy bandwidth its weight bytes are; then a decode step's
products summed: F.linear, the best launch per shape, and the rule's own launch.

`--update` writes each shape's fastest launch into the kernel module's `MEASURED` table (the
source file of this checkout), which `launch_shape` reads first.

    python benchmarks/gemv.py [--out DIR] [--shapes N:K:count,...] [--replays 20] [--update]"""
from __future__ import annotations

import argparse
import copy
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from hebrus.ops.cuda.gemv import gated_launch_shape, launch, launch_shape, silu_gated

# (outputs, inputs, products a decode step) of the qwen3.5-1.7b shape (18 GDN layers, 6 attention):
# the GDN in-projection (qkv, z, b, a side by side), the GDN and attention out-projections,
# attention's q+gate, k, v side by side, the MLP's gate+up and down, the tied head
SHAPES = ((8224, 2048, 18), (2048, 2048, 24), (5120, 2048, 6), (12288, 2048, 24), (2048, 6144, 24),
          (151936, 2048, 1))
# BLOCK_N, BLOCK_K, warps, a program's tile at most 8K elements (its float32 partial sums in registers)
CONFIGS = [(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048), (2, 4, 8))
           if n * k <= 8192]
GATE_UP = (12288, 2048)           # the gate and up products side by side: `silu_gated` timed on it too
MODULE = Path(__file__).resolve().parents[1] / "src" / "hebrus" / "ops" / "cuda" / "gemv.py"


def per_call(call, weights: list, calls: int = 50, replays: int = 20) -> float:
    """Seconds per call of `call(w)`: `calls` calls captured in one graph, taking the copies in
    `weights` in turn (enough of them that the ones read between two reads of one overflow the
    cache, as a step's weights do: with one weight called 50 times, a 33 MB weight stayed in an
    H200's 50 MB L2 and was timed at 135% of the copy bandwidth), replayed `replays` times."""
    call(weights[0])
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(weights[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (calls * replays)


def cold_copies(w) -> list:
    """`w` (a weight, or a quantized one) and as many copies as make the bytes read between two
    reads of one at least twice the device's L2 cache."""
    tensor = w if isinstance(w, torch.Tensor) else w.qweight
    size = w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
    cache = getattr(torch.cuda.get_device_properties(tensor.device), "L2_cache_size", 64 * 2**20)
    n = max(1, -(-2 * cache // size) + 1)
    return [w] + [w.clone() if isinstance(w, torch.Tensor) else copy.deepcopy(w) for _ in range(n - 1)]


def main() -> None:
    from hebrus.bench.limits import copy_bandwidth
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--shapes", help="N:K:count triples, comma-separated (default: the 1.68B shape's)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--update", action="store_true",
                        help=f"write each shape's fastest launch into MEASURED in {MODULE}")
    args = parser.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")]
    if any(len(shape) != 3 for shape in shapes):
        parser.error("--shapes takes N:K:count triples, e.g. 8224:2048:18")
    bandwidth = copy_bandwidth(torch.device("cuda"), 2**30)
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; x: one bf16 row; µs a call (50 a graph), share of it"]
    g = torch.Generator(device="cuda").manual_seed(0)
    total = {"F.linear": 0.0, "best": 0.0, "rule": 0.0}
    rule_before = {shape[:2]: launch_shape(*shape[:2]) for shape in shapes}
    fastest: dict[tuple[int, int], tuple[int, int, int]] = {}
    for N, K, count in shapes:
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
        x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        weights = cold_copies(w)
        want = F.linear(x.float(), w.float())
        weight = N * K * 2
        t = per_call(lambda w: F.linear(x, w), weights, replays=args.replays)
        lines.append(f"\n## {N} x {K} ({count} a step)\nF.linear: {t * 1e6:.1f} µs, {weight / t / bandwidth:.0%}")
        total["F.linear"] += count * t
        results = []
        for block_n, block_k, warps in CONFIGS:
            try:
                got = launch(x, w, (block_n, block_k, warps))
            except Exception as exc:                # a launch this Triton cannot build: said, skipped
                lines.append(f"{block_n}x{block_k}/{warps}: FAILED, {type(exc).__name__}: {str(exc)[:100]}")
                continue
            error = float((got.float() - want).norm() / want.norm())
            if error > 1e-2:
                lines.append(f"{block_n}x{block_k}/{warps}: WRONG, relative error {error:.2e}")
                continue
            t = per_call(lambda w: launch(x, w, (block_n, block_k, warps)), weights, replays=args.replays)
            results.append((t, block_n, block_k, warps))
        results.sort()
        for t, block_n, block_k, warps in results[:3]:
            lines.append(f"triton {block_n}x{block_k}/{warps} warps: {t * 1e6:.1f} µs, {weight / t / bandwidth:.0%}")
        total["best"] += count * results[0][0] if results else float("nan")
        if results:
            fastest[N, K] = results[0][1:]
        rule = next((t for t, *shape in results if tuple(shape) == rule_before[N, K]), float("nan"))
        lines.append(f"the rule's launch {rule_before[N, K]}: {rule * 1e6:.1f} µs")
        total["rule"] += count * rule
        print("\n".join(lines[-5:]), flush=True)
        if (N, K) == GATE_UP:
            lines.append(gated(x, w, weights, weight, bandwidth, args.replays))
            print(lines[-1], flush=True)
    lines.append(f"\na decode step's products: F.linear {total['F.linear'] * 1e6:.0f} µs, the best Triton "
                 f"launch per shape {total['best'] * 1e6:.0f} µs, the rule's {total['rule'] * 1e6:.0f} µs")
    print(lines[-1])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv.txt").write_text("\n".join(lines) + "\n")
    if args.update:
        update(fastest, torch.cuda.get_device_name())
        print(f"wrote {len(fastest)} launches into {MODULE}")


def gated(x, w, weights, weight, bandwidth, replays) -> str:
    """SwiGLU's gate and up products with its middle (`gemv.silu_gated`) on this [gate; up]
    weight: at the launch it takes (the table's for the weight) and at the fastest of CONFIGS."""
    N, K = w.shape[0] // 2, w.shape[1]
    timed = []
    for shape in CONFIGS:
        try:
            timed.append((per_call(lambda w: silu_gated(x, w, shape), weights, replays=replays), *shape))
        except Exception:                           # a launch this Triton cannot build
            continue
    timed.sort()
    taken = gated_launch_shape(2 * N, K)
    at = next((t for t, *shape in timed if tuple(shape) == taken), float("nan"))
    best = timed[0] if timed else (float("nan"), 0, 0, 0)
    return (f"silu_gated (the product and SwiGLU's middle): {at * 1e6:.1f} µs at its launch {taken}, "
            f"{weight / at / bandwidth:.0%}; fastest {best[1]}x{best[2]}/{best[3]} warps {best[0] * 1e6:.1f} µs")


def update(fastest: dict, device: str) -> None:
    """Rewrite the `MEASURED = {...}` table of the kernel module: its rows for these shapes
    replaced, the others kept."""
    from hebrus.ops.cuda.gemv import MEASURED
    table = {**MEASURED, **fastest}
    text = MODULE.read_text()
    begin = text.index("MEASURED: dict[")
    end = text.index("\n}\n", begin) + 3
    rows = "".join(f"    {key!r}: {value!r},\n" for key, value in sorted(table.items()))
    MODULE.write_text(text[:begin] + f"MEASURED: dict[tuple[int, int], tuple[int, int, int]] = {{   # {device}\n"
                      + rows + "}\n" + text[end:])


if __name__ == "__main__":
    main()
