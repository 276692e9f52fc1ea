"""Where one QSA decode query's time goes at long context on a GPU: each part of the layer's
pick-and-attend timed alone (captured in a CUDA graph and replayed, as a decode step runs it),
top-k variants side by side (and a selection kernel set aside, `diag/select_kernel.py`, checked
against the twin first), and a kernel profile of the whole call at the longest context.
    python benchmarks/qsa_layer.py [--out DIR]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hebrus.bench.limits import copy_bandwidth
from hebrus.bench.long import _time_calls
from hebrus.ops.choose import top_k_packed, top_k_sorted
from hebrus.ops.qsa import index_scores, picked_rows, select, sparse_attention, visible

sys.path.insert(0, str(Path(__file__).resolve().parent / "diag"))
from select_kernel import check, select as selection  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="/tmp")
parser.add_argument("--contexts", default="1024,8192,32768,131072")
args = parser.parse_args()
device, dtype = torch.device("cuda"), torch.bfloat16
hi, di, hq, hkv, dh, K = 4, 64, 8, 2, 64, 64           # the small preset's QSA layer
bandwidth = copy_bandwidth(device, 2**30)
print(f"the selection kernel: {check(device)} cases equal to the twin", flush=True)


def two_stage(scores: torch.Tensor, k: int, block: int = 1024) -> torch.Tensor:
    """Packed keys, top k of each block of the row, then top k of the survivors (same result)."""
    T, N = scores.shape
    x = scores.float() + 0.0
    x = torch.where(torch.isnan(x), float("nan"), x)
    bits = x.view(torch.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long() * 2**32 + (2**32 - 1 - torch.arange(N, device=x.device))
    pad = (-N) % block
    keys = torch.nn.functional.pad(keys, (0, pad), value=torch.iinfo(torch.int64).min)
    best = torch.topk(keys.view(T, -1, block), min(k, block), dim=-1).values.view(T, -1)
    return 2**32 - 1 - (torch.topk(best, k, dim=-1).values & (2**32 - 1))


lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); one query, bf16, "
         f"index {hi}x{di}, top_k {K}, K/V {hkv}x{dh}"]
for N in map(int, args.contexts.split(",")):
    g = torch.Generator(device="cpu").manual_seed(N)
    ki = torch.randn(N, di, generator=g).to(device, dtype)
    qi, iw = torch.randn(1, hi, di, generator=g).to(device, dtype), torch.randn(1, hi, generator=g).to(device, dtype)
    q = torch.randn(1, hq, dh, generator=g).to(device, dtype)
    k_rows, v_rows = (torch.randn(N, hkv, dh, generator=g).to(device, dtype) for _ in range(2))
    pos = torch.tensor([N - 1], device=device)
    scores = visible(index_scores(qi, iw, ki), pos)
    assert torch.equal(top_k_sorted(scores, K), top_k_packed(scores, K))
    assert torch.equal(torch.sort(top_k_sorted(scores, K)).values, torch.sort(two_stage(scores, K)).values)
    picked, valid = picked_rows(top_k_sorted(scores, K), pos)
    chosen = selection(scores, pos, K)
    assert torch.equal(chosen[0], picked) and torch.equal(chosen[1], valid)
    parts = {
        "index scores + mask": lambda: visible(index_scores(qi, iw, ki), pos),
        "top-k: stable sort": lambda: top_k_sorted(scores, K),
        "top-k: packed keys": lambda: top_k_packed(scores, K),
        "top-k: packed, two stages": lambda: two_stage(scores, K),
        "top-k: torch.topk on the floats (ties unordered)": lambda: torch.topk(scores, K).indices,
        "sorted pick + mask": lambda: picked_rows(top_k_sorted(scores, K), pos),
        "the selection as the model ran it before (stable sort, sorted pick)": lambda: select(scores, pos, K),
        "a selection kernel (diag/select_kernel.py, the same rows)": lambda: selection(scores, pos, K),
        "attention over the pick": lambda: sparse_attention(q, k_rows, v_rows, picked, valid),
    }
    lines.append(f"\n## context {N}: index keys {N * di * 2:,} bytes, floor {N * di * 2 / bandwidth * 1e6:.2f} µs")
    for name, call in parts.items():
        lines.append(f"{name}: {_time_calls(call, device, 100) * 1e6:.1f} µs")
        print(lines[-1], flush=True)

from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        s = visible(index_scores(qi, iw, ki), pos)
        p, v = selection(s, pos, K)
        sparse_attention(q, k_rows, v_rows, p, v)
    torch.cuda.synchronize()
lines.append("\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
Path(args.out, "qsa-layer-h200.txt").write_text("\n".join(lines) + "\n")
print(lines[-1])
