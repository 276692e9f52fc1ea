"""Where a batched decode step's time goes on a GPU: N sessions at one context stepping from the
model's graph runner; wall time per step, the host's share (staging, the transaction's begin,
validation and publication) against the replay, the host's functions by their own time, the step timed as `hebrus bench` times it (rows
stacked, a sync a step, the next ids by argmax), and the top kernels of a profiled replay.
    python benchmarks/batch_profile.py [--model qwen3.5-1.7b] [--context 1024] [--batch 64] [--out DIR]"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import Counter
from pathlib import Path

import torch

import hebrus
from gpu_model import model_and_prompt, options
from hebrus.engine import graphs

args = options("qwen3.5-1.7b", 30, batch=(str, "64"))
model, prompt = model_and_prompt(args)
first = model.session()
first.prefill(prompt, chunk_size=2048)
lines = []
for batch in [int(b) for b in args.batch.split(",")]:
    sessions = [first] + [first.fork(copy_rows=True) for _ in range(batch - 1)]
    group = hebrus.Batch(sessions)
    runner = group._steps
    spent: Counter = Counter()
    # host time split: wrap the runner's pieces
    originals = {"_stage": graphs.Steps._stage, "_transaction": graphs.Steps._transaction}

    def timed(label, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            spent[label] += time.perf_counter() - t
            return out
        return wrapper

    for t in range(6):
        group.feed([t % 7] * batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in range(args.steps):
        group.feed([t % 7] * batch)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    graph = next(g for k, g in runner.graphs.items() if k[0] == graphs.lanes_for(batch)).graph   # this batch's
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - t0) / args.steps * 1e3
    # as `hebrus bench` times a step: the returned rows stacked and a sync after each step, the
    # next ids chosen from them by argmax outside the timing
    last, like_bench = torch.stack(group.feed([1] * batch)), 0.0
    for t in range(args.steps):
        ids = torch.argmax(last, dim=-1).tolist()
        t0 = time.perf_counter()
        last = torch.stack(group.feed(ids))
        torch.cuda.synchronize()
        like_bench += time.perf_counter() - t0
    like_bench = like_bench / args.steps * 1e3
    graphs.Steps._stage = timed("stage", originals["_stage"])
    graphs.Steps._transaction = timed("begin", originals["_transaction"])
    for t in range(args.steps):
        group.feed([t % 7] * batch)
    graphs.Steps._stage, graphs.Steps._transaction = originals["_stage"], originals["_transaction"]
    lines.append(f"batch {batch} at {args.context}: {wall:.3f} ms a step ({batch / wall * 1e3:,.0f} tok/s); "
                 f"replay alone {replay:.3f} ms; as the bench steps {like_bench:.3f} ms; begin {spent['begin'] / args.steps * 1e3:.3f} ms, "
                 f"stage {spent['stage'] / args.steps * 1e3:.3f} ms; captures={runner.captures} "
                 f"replays={runner.replays} uncaptured={runner.uncaptured} keys={sorted(runner.graphs)}")
    print(lines[-1], flush=True)
    # the host's own time per function, over the same steps (the device's time hidden behind it)
    host = cProfile.Profile()
    host.enable()
    for t in range(args.steps):
        group.feed([t % 7] * batch)
    torch.cuda.synchronize()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
    lines.append(f"batch {batch}: host functions over {args.steps} steps, by own time\n{text.getvalue()}")
    print(lines[-1][:5000], flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(5):
            group.feed([t % 7] * batch)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernels = sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    table = averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    lines.append(f"batch {batch}: {kernels / 5:.0f} device ops a step (5 profiled)\n{table}")
    print(table[:6000], flush=True)
    del sessions, group
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / f"batch-profile-{Path(args.model).name}.txt").write_text("\n".join(lines) + "\n")
