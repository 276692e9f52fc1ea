"""Where a decode step's time goes on a GPU: per-step wall time of each decode route, the graph
runner's counters, and a profile of a few steps (top kernels and host ops), then the host's
Python for the graph route's steps (cProfile, by own time and by cumulative time).
    python benchmarks/decode_profile.py [--model small] [--context 1024] [--routes graph,planned,eager] [--out DIR]"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from gpu_model import model_and_prompt, options

args = options("small", 40, routes=(str, "graph,planned,eager"))
model, prompt = model_and_prompt(args)
lines = []
for decode in args.routes.split(","):
    s = model.session(decode=decode)
    s.prefill(prompt, chunk_size=2048)
    for t in range(8):
        s.feed([t])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in range(args.steps):
        s.feed([t])
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    steps = s._steps
    extra = "" if steps is None else (f" captures={steps.captures} replays={steps.replays} "
                                      f"uncaptured={steps.uncaptured} refused={steps.refused}")
    lines.append(f"{decode}: {ms:.3f} ms/step{extra}")
    print(lines[-1], flush=True)
    if decode == "graph":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for t in range(5):
                s.feed([t])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        Path(args.out, f"profile-{args.model}.txt").write_text("\n".join(lines) + "\n\n" + table + "\n\n" + host)
        python = cProfile.Profile()
        python.enable()
        for t in range(args.steps):
            s.feed([t])
        torch.cuda.synchronize()
        python.disable()
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(python, stream=text).sort_stats(order).print_stats(30)
        Path(args.out, f"host-python-{args.model}.txt").write_text(
            f"cProfile of {args.steps} graph-route steps of {args.model}\n" + text.getvalue())
Path(args.out, f"decode-{args.model}.txt").write_text("\n".join(lines) + "\n")
