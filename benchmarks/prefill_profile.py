"""Where a prefill's time goes on a GPU: one session's prompt of --context tokens fed in chunks
of each --chunks length, wall time and tokens/s of each (after a warm prefill at that length),
then a profile of one prefill at each: the device's busy time against the wall, kernels a chunk,
the top kernels by device time and the top host ops; with --host 1, instead, the host's Python
functions by their own time over one prefill (the device's work hidden behind them).
    python benchmarks/prefill_profile.py [--model qwen3.5-1.7b] [--context 8192] [--chunks 2048,8192] [--host 1] [--out DIR]"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_model import model_and_prompt, options

args = options("qwen3.5-1.7b", 3, context=8192, chunks=(str, "2048,8192"), host=(int, 0))
model, prompt = model_and_prompt(args)
lines = []


def prefill(chunk: int) -> float:
    s = model.session()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    s.prefill(prompt, chunk_size=chunk)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


for chunk in [int(c) for c in args.chunks.split(",")]:
    prefill(chunk)                                   # warm: compiles and plans at this length
    spent = sorted(prefill(chunk) for _ in range(args.steps))
    wall = spent[len(spent) // 2]
    lines.append(f"prefill of {args.context} in chunks of {chunk}: {wall * 1e3:.1f} ms "
                 f"({args.context / wall:,.0f} tok/s, median of {args.steps})")
    print(lines[-1], flush=True)
    if args.host:
        host = cProfile.Profile()
        host.enable()
        prefill(chunk)
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(45)
        lines.append(text.getvalue())
        print(lines[-1][:12000], flush=True)
        continue
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(chunk)
    averages = prof.key_averages()
    cuda = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in cuda) / 1e3
    kernels = sum(e.count for e in cuda)
    chunks = -(-args.context // chunk)
    lines.append(f"  device busy {busy:.1f} ms of the wall; {kernels} device ops ({kernels / chunks:.0f} a chunk)")
    print(lines[-1], flush=True)
    lines.append(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=90))
    print(lines[-2][:8000], flush=True)
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / f"prefill-profile-{Path(args.model).name}.txt").write_text("\n".join(lines) + "\n")
