"""The quantized decode products against the bytes they read, on a GPU: each format's Triton
kernel at several launch shapes, beside bf16 F.linear and the rebuilt twin, on the 1.68B shape's
largest projections. 50 calls captured in one graph, each on another copy of the weight (none
read from the L2: `gemv.cold_copies`), replayed; µs per call and the fraction of the copy bandwidth.
    python benchmarks/quant_gemv.py [--out DIR]"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from gemv import cold_copies, per_call
from hebrus.bench.limits import copy_bandwidth
from hebrus.ops.cuda.quant import launch
from hebrus.ops.quant import quantize, rebuilt_linear

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="/tmp")
parser.add_argument("--formats", default="int8,int4,int4-zp,fp8")
args = parser.parse_args()
wanted = args.formats.split(",")
device = torch.device("cuda")
bandwidth = copy_bandwidth(device, 2**30)
lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; x: one bf16 row"]
for N, K in ((6144, 2048), (4096, 4096)):
    w = torch.randn(N, K, device=device)
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    wb = w.bfloat16()
    t = per_call(lambda w: F.linear(x, w), cold_copies(wb))
    lines.append(f"\n## {N} x {K}\nbf16 F.linear: {t * 1e6:.1f} µs, {N * K * 2 / t / bandwidth:.0%} of bandwidth")
    for fmt, zp in (("int8", False), ("int4", False), ("int4", True), ("fp8", False)):
        name = fmt + ("-zp" if zp else "")
        if name not in wanted:
            continue
        q = quantize(w, fmt, zero_point=zp)
        copies = cold_copies(q)
        t = per_call(lambda q: rebuilt_linear(x, q), copies[:1], calls=10)
        lines.append(f"{name} rebuilt: {t * 1e6:.1f} µs")
        best = None
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for block_k in ((512, 1024) if fmt == "int4" else (128, 512) if fmt == "int8" else (128,)):
                    try:
                        t = per_call(lambda q: launch(x, q, block_n, block_k, warps), copies)
                    except Exception as exc:
                        lines.append(f"{name} n{block_n} k{block_k} w{warps}: {type(exc).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, block_n, block_k, warps)
        t, block_n, block_k, warps = best
        lines.append(f"{name} best: {t * 1e6:.1f} µs (block_n {block_n}, block_k {block_k}, warps {warps}), "
                     f"{q.nbytes / t / bandwidth:.0%} of bandwidth, {q.nbytes:,} bytes")
        print(lines[-1], flush=True)
Path(args.out, f"quant-gemv-h200-{'-'.join(wanted)}.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
