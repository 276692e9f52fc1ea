"""The decode step's own kernels alone on a GPU, timed as a graph replays them (50 launches captured
in one CUDA graph, replayed; microseconds a launch): the lanes' attention (its tile, warps and
spread swept, against its readable twin), a Gated DeltaNet's lanes kernels against theirs, and an
RMS norm compiled as the fused ops compile it (dynamic from the first call) against compiled for
each row count, at N sessions of the 1.68B Qwen3.5 shape. Each line also gives the bytes a launch
must move over the device's copy bandwidth.
    python benchmarks/decode_kernels.py [--batch 1,8,64,256] [--context 1024] [--out DIR]"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from hebrus.bench import copy_bandwidth
from hebrus.ops import norm
from hebrus.ops.cuda import attention_lanes
from hebrus.ops.cuda.gdn_lanes import gdn_lanes_cuda
from hebrus.ops.gdn import gdn_lanes
from hebrus.ops.qsa import dense_attention_lanes
from hebrus.state.context import InPlace

REPS = 50


def graph_time(fn) -> float:
    """Microseconds a call of `fn` takes inside a CUDA graph of REPS calls (median of 5 replays)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,8,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default="/tmp")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"), 2**30)
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds a launch inside a graph of {REPS}"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    dev, bf = "cuda", torch.bfloat16
    hq, hkv, dh, R = 8, 2, 256, 16
    for N in [int(b) for b in args.batch.split(",")]:
        W = -(-args.context // R)
        k_blocks, v_blocks = (torch.randn(N * W + 2, R, hkv, dh, device=dev, dtype=bf) for _ in range(2))
        tables = torch.randperm(N * W, device=dev).view(N, W)
        q = torch.randn(N, hq, dh, device=dev, dtype=bf)
        positions = torch.full((N,), args.context - 1, device=dev)
        floor = 2 * N * args.context * hkv * dh * 2 / bandwidth * 1e6
        twin = graph_time(lambda: dense_attention_lanes(q, k_blocks, v_blocks, tables, positions))
        say(f"attention N={N} ctx={args.context}: floor {floor:.1f} us; twin {twin:.1f} us")
        defaults = attention_lanes.TILE, attention_lanes.WARPS, attention_lanes.SPREAD
        for tile, warps, spread in itertools.product((16, 32, 64), (4, 8), (2, 4, 8)):
            attention_lanes.TILE, attention_lanes.WARPS, attention_lanes.SPREAD = tile, warps, spread
            took = graph_time(lambda: attention_lanes.attention_lanes_cuda(q, k_blocks, v_blocks, tables, positions))
            say(f"  tile {tile} warps {warps} spread {spread}: {took:.1f} us ({floor / took:.0%} of floor)")
        attention_lanes.TILE, attention_lanes.WARPS, attention_lanes.SPREAD = defaults

        hk, dk, hv, dv, Kc = 16, 128, 16, 128, 4
        C = 2 * hk * dk + hv * dv
        projected = torch.randn(N, C, device=dev, dtype=bf)
        b, a = (torch.randn(N, hv, device=dev, dtype=bf) for _ in range(2))
        conv_w = torch.randn(C, Kc, device=dev, dtype=bf)
        neg_a, dt_bias = -torch.rand(hv, device=dev), torch.randn(hv, device=dev) * 0.1
        conv = InPlace(torch.zeros(2, N, C, Kc - 1, device=dev, dtype=bf), torch.zeros(N, dtype=torch.long, device=dev),
                       torch.ones(N, dtype=torch.long, device=dev), torch.arange(N, device=dev))
        rec = InPlace(torch.zeros(2, N, hv, dk, dv, device=dev), conv.source, conv.target, conv.slots)
        floor = N * (2 * hv * dk * dv * 4 + 2 * C * (Kc - 1) * 2) / bandwidth * 1e6
        heads = (hk, dk, hv, dv)
        kernel = graph_time(lambda: gdn_lanes_cuda(projected, b, a, conv_w, neg_a, dt_bias, heads, conv, rec))
        twin = graph_time(lambda: gdn_lanes(projected, b, a, conv_w, neg_a, dt_bias, heads, conv, rec))
        say(f"gdn N={N}: floor {floor:.1f} us; kernels {kernel:.1f} us ({floor / kernel:.0%}); twin {twin:.1f} us")

        x, w = torch.randn(N, 2048, device=dev, dtype=bf), torch.randn(2048, device=dev, dtype=bf)
        torch._dynamo.reset()
        dynamic = torch.compile(norm.rms_norm, fullgraph=True, dynamic=True)
        dynamic(torch.randn(1, 2048, device=dev, dtype=bf), w, 1e-6)        # first met at one row
        static = torch.compile(norm.rms_norm, fullgraph=True, dynamic=False)
        floor = 2 * N * 2048 * 2 / bandwidth * 1e6
        say(f"rms_norm N={N}: floor {floor:.2f} us; compiled dynamic {graph_time(lambda: dynamic(x, w, 1e-6)):.1f} us; "
            f"static {graph_time(lambda: static(x, w, 1e-6)):.1f} us; eager {graph_time(lambda: norm.rms_norm(x, w, 1e-6)):.1f} us")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode-kernels.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
