"""Where a batched decode step's time goes on a GPU: N sessions at one context stepping from the
model's graph runner; wall time per step, the host's share (staging, the transaction's begin,
validation and publication) against the replay, and the top kernels of a profiled replay.
    python benchmarks/batch_profile.py [--model qwen3.5-1.7b] [--context 1024] [--batch 64] [--out DIR]"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch

import hebrus
from hebrus import bench
from hebrus.engine import graphs

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="qwen3.5-1.7b")
parser.add_argument("--context", type=int, default=1024)
parser.add_argument("--batch", default="64")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--out", default="/tmp")
parser.add_argument("--cache", default="/tmp/shapes")
args = parser.parse_args()
name = args.model
if name in bench.SHAPES:
    name = str(bench.random_checkpoint(name, Path(args.cache) / name))
model = hebrus.load(name, device="cuda", dtype="bfloat16", mode="fast")
prompt = torch.randint(0, model.spec.vocab_size, (args.context,)).tolist()
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
    graph = next(iter(runner.graphs.values())).graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - t0) / args.steps * 1e3
    graphs.Steps._stage = timed("stage", originals["_stage"])
    graphs.Steps._transaction = timed("begin", originals["_transaction"])
    for t in range(args.steps):
        group.feed([t % 7] * batch)
    graphs.Steps._stage, graphs.Steps._transaction = originals["_stage"], originals["_transaction"]
    lines.append(f"batch {batch} at {args.context}: {wall:.3f} ms a step ({batch / wall * 1e3:,.0f} tok/s); "
                 f"replay alone {replay:.3f} ms; begin {spent['begin'] / args.steps * 1e3:.3f} ms, "
                 f"stage {spent['stage'] / args.steps * 1e3:.3f} ms; captures={runner.captures} "
                 f"replays={runner.replays} uncaptured={runner.uncaptured} keys={sorted(runner.graphs)}")
    print(lines[-1], flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(5):
            group.feed([t % 7] * batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    lines.append(table)
    print(table[:6000], flush=True)
    del sessions, group
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / f"batch-profile-{Path(name).name}.txt").write_text("\n".join(lines) + "\n")
