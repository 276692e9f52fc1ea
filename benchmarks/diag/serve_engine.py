"""Is serving's throughput at 64 clients the engine's or the server's? `hebrus bench --serve`'s
uniform workload (64 requests of 128 prompt tokens and 64 greedy output tokens, all arriving at
once) fed to the engine loop alone: no HTTP, no clients, no other thread; the loop's turns run
in this thread as the engine thread runs them, with the server's defaults (cache off, as the
bench has it). On an H100 at 7c74ec4 the server delivered 3,543 tokens/s there, its engine
thread spending 0.26 s admitting, 0.39 s prefilling and 0.37 s in 65 replayed steps of 1.16 s
(results/cuda-h100/7c74ec4/bench-serve-8192.md).

Reported: the time to make a session, tokens/s from the first submission to the last token, the time to each request's
first token (p50, p99), each turn's seconds and what it did, the loop's own account (`spent`),
then a second round under cProfile (its top functions by own time and by total) and, on CUDA,
a third whose first turn (admitting and feeding every prompt) runs under torch.profiler.

    python benchmarks/diag/serve_engine.py [--model qwen3.5-1.7b] [--clients 64] [--prompt 128] [--tokens 64]
        [--spares 4,64]
    (on a CPU: --model shakespeare)"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hebrus  # noqa: E402
from hebrus import bench  # noqa: E402
from hebrus.bench.limits import sync  # noqa: E402
from hebrus.bench.serve import prompts  # noqa: E402
from hebrus.sampling import Sampling  # noqa: E402
from hebrus.scheduling.scheduler import Request, Scheduler  # noqa: E402


def round_of(loop: Scheduler, asks: list[list[int]], tokens: int, turns: list | None = None,
             first_turn=None) -> dict:
    """Every ask submitted at once, the loop's turns run here until each has its tokens;
    `first_turn`, if given, a context the first turn runs in. The loop's spare sessions are made
    first, as its idle thread makes them between rounds."""
    del loop.spares[loop.spare_sessions:]              # as many as the round asks, no more
    while len(loop.spares) < loop.spare_sessions:
        loop.spares.append(loop.model.session(decode="eager"))
    firsts, last = {}, [0.0]

    def emit_for(i):
        def emit(kind, value):
            now = time.perf_counter()
            if kind == "token":
                firsts.setdefault(i, now)
                last[0] = now
            elif kind == "error":
                raise RuntimeError(f"request {i} failed: {value!r}")
        return emit

    loop.spent.clear()
    began = time.perf_counter()
    requests = [Request(key="k", prompt=ids, max_tokens=tokens, sampling=Sampling(), seed=i,
                        stop_ids=frozenset(), emit=emit_for(i)) for i, ids in enumerate(asks)]
    loop.waiting.extend(requests)
    while loop.waiting or loop.running:
        loop._take_waiting()
        fed = sum(r.fed for r in requests)
        decoding = sum(r.fed >= len(r.prompt) for r in loop.running)
        t = time.perf_counter()
        if first_turn is not None:
            with first_turn:
                loop._turn()
                sync(loop.model.device)
            first_turn = None
        else:
            loop._turn()
            sync(loop.model.device)
        if turns is not None:
            turns.append((time.perf_counter() - t, sum(r.fed for r in requests) - fed, decoding))
    sync(loop.model.device)
    wall = time.perf_counter() - began
    ttft = sorted(f - began for f in firsts.values())
    return {"wall": wall, "tok_s": len(asks) * tokens / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "spent": dict(loop.spent)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.5-1.7b")
    parser.add_argument("--cache", default="/tmp/shapes")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=None)
    parser.add_argument("--spares", default="",
                        help="after the report, a round with each of these numbers of spare sessions "
                             "made before it (comma-separated; the loop's default is its own)")
    args = parser.parse_args()
    name = args.model
    if name in bench.SHAPES:
        name = str(bench.random_checkpoint(name, Path(args.cache) / name))
    cuda = torch.cuda.is_available()
    model = hebrus.load(name, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                        mode="fast")
    loop = Scheduler(model, max_sessions=args.clients, cache_bytes=0, prefill_tokens=args.prefill_tokens)
    default_spares = loop.spare_sessions
    t = time.perf_counter()
    loop.warm_up(lambda part: print(f"  warm-up: {part}", flush=True))
    print(f"{args.model} on {model.device}: warmed up in {time.perf_counter() - t:.1f} s; route {loop.decode}, "
          f"passes {loop.passes}, a turn's prompt tokens {loop.prefill_tokens}, spare sessions {loop.spare_sessions}")
    sync(model.device)
    t = time.perf_counter()
    made = [model.session(decode="eager") for _ in range(args.clients)]
    sync(model.device)
    print(f"a new session: {(time.perf_counter() - t) / args.clients * 1e3:.3f} ms (mean of {args.clients}, "
          f"made one after another)")
    del made
    asks = prompts(model.spec.vocab_size, args.clients, args.prompt, seed=args.clients)
    round_of(loop, prompts(model.spec.vocab_size, args.clients, args.prompt, seed=1), args.tokens)   # untimed
    turns = []
    first = round_of(loop, asks, args.tokens, turns)
    print(f"\n{args.clients} requests of {args.prompt} prompt tokens, {args.tokens} tokens each: "
          f"{first['wall']:.3f} s, {first['tok_s']:,.0f} tokens/s; TTFT p50 {first['ttft_p50'] * 1e3:.1f} ms, "
          f"p99 {first['ttft_p99'] * 1e3:.1f} ms")
    print("  spent (s): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(first["spent"].items(), key=lambda kv: -kv[1])))
    print("  turns (ms, prompt tokens fed, requests decoding before it):")
    for i, (seconds, fed, decoding) in enumerate(turns):
        if i < 8 or fed or i == len(turns) - 1:
            print(f"    {i:3}: {seconds * 1e3:8.2f} ms  fed {fed:5}  decoding {decoding}")
    steps = [s for s, fed, d in turns if not fed and d]
    if steps:
        print(f"    decode-only turns: {len(steps)}, median {statistics.median(steps) * 1e3:.2f} ms")
    for spares in [int(n) for n in args.spares.split(",") if n]:
        loop.spare_sessions = spares
        made = round_of(loop, asks, args.tokens)
        print(f"with {spares} spare sessions: {made['wall']:.3f} s, {made['tok_s']:,.0f} tokens/s; TTFT p50 "
              f"{made['ttft_p50'] * 1e3:.1f} ms; admitting {made['spent'].get('admit', 0.0) * 1e3:.1f} ms")
    loop.spare_sessions = default_spares
    profile = cProfile.Profile()
    profile.enable()
    again = round_of(loop, asks, args.tokens)
    profile.disable()
    print(f"\nunder cProfile: {again['wall']:.3f} s, {again['tok_s']:,.0f} tokens/s")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(30)
        print(text.getvalue()[text.getvalue().find("   ncalls"):])
    if model.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as kernels
        traced = kernels(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        round_of(loop, asks, args.tokens, first_turn=traced)
        averages = traced.key_averages()
        print("\nthe first turn (admitting and feeding the prompts) under torch.profiler:")
        print(averages.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
