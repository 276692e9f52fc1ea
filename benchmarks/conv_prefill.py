"""A Gated DeltaNet's conv over a prefill chunk of the 1.68B shape (C 6144 channels read from the
projection group's 8224-wide rows, K 4): the compiled `gdn_inputs` with every size symbolic
(as a chunk ran until 43af311), made for this length, and in the shared form
`hebrus.ops.cuda.fuse` now gives every length (the rows symbolic, the widths constant); the
compiled conv and SiLU alone, and eager torch; device time per call. (A Triton conv tried at 43af311, 189 us against the compiled
conv's 233, was not kept.)
    python benchmarks/conv_prefill.py [--context 8192] [--out DIR]"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_model import options
from hebrus.ops.conv import causal_conv
from hebrus.ops.cuda.fuse import _Fused
from hebrus.ops.gdn import gdn_inputs

args = options("qwen3.5-1.7b", 20, context=8192)
T, C, W, H, K = args.context, 6144, 8224, 16, 4
dev, bf = "cuda", torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)
group = torch.randn(T, W, device=dev, dtype=bf, generator=gen)
projected, b, a = group[:, :C], group[:, C + 2048:C + 2048 + H], group[:, C + 2048 + H:]
state = torch.randn(C, K - 1, device=dev, dtype=bf, generator=gen).transpose(0, 1)     # as the bank holds it
weight = torch.randn(C, K, device=dev, dtype=bf, generator=gen) * 0.5
neg_a, dt_bias = -torch.rand(H, device=dev), torch.rand(H, device=dev)
heads = (16, 128, 16, 128)
lines = []


def timed(name, fn, *xs):
    for _ in range(3):
        fn(*xs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        fn(*xs)
    end.record()
    torch.cuda.synchronize()
    lines.append(f"{name}: {start.elapsed_time(end) / args.steps * 1e3:.1f} us")
    print(lines[-1], flush=True)


def conv_silu(x, s, w):
    y, s = causal_conv(x, s, w)
    return F.silu(y), s


t0 = time.perf_counter()
timed("eager conv+silu", conv_silu, projected, state, weight)
timed("copy of the rows (a floor: read + write C columns)", lambda x: x.contiguous(), projected)
for dynamic in (False, True):
    c = torch.compile(conv_silu, fullgraph=True, dynamic=dynamic)
    timed(f"compiled conv+silu, dynamic={dynamic}", c, projected, state, weight)
    g = torch.compile(gdn_inputs, fullgraph=True, dynamic=dynamic)
    timed(f"compiled gdn_inputs, dynamic={dynamic}", g, projected, b, a, state, weight, neg_a, dt_bias, heads)
timed("fused gdn_inputs, the shared form", _Fused(gdn_inputs), projected, b, a, state, weight, neg_a, dt_bias, heads)
lines.append(f"(whole run {time.perf_counter() - t0:.0f} s)")
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / f"conv-prefill-{args.context}.txt").write_text("\n".join(lines) + "\n")
