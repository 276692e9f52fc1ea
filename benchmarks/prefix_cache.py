"""The prefix cache under a shared system prompt (serving workload (b)), on the engine loop
without HTTP: clients whose prompts share a `--system`-token system prompt and differ in their
last `--own` tokens, each asking `--tokens` greedy tokens.

Two runs in one process, the cache on and off, each: one request alone (cold: it finds nothing),
then `--clients` requests at once (with the cache on, they find the system prompt the first one
left), then one request alone again (with the cache on, a hit). Reported per run: the time to
first token of the requests alone, and the clients' output tokens/s and time to first token
(p50, p99). The ratios that matter: a cached request's TTFT over a cold one's, and the clients'
throughput with the cache over without.

    python benchmarks/prefix_cache.py --model shakespeare --mode fast --json out.json
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch

import hebrus
from hebrus.sampling import Sampling
from hebrus.scheduling.scheduler import Request, Scheduler


def _asks(vocab: int, count: int, system: int, own: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, vocab, (system,), generator=gen).tolist()
    return [shared + torch.randint(0, vocab, (own,), generator=gen).tolist() for _ in range(count)]


def _submit(scheduler: Scheduler, prompts: list[list[int]], tokens: int) -> dict:
    """The requests at once -> seconds to each one's first token, and to the last token of all."""
    started, firsts, done = time.perf_counter(), {}, threading.Semaphore(0)

    def emit_for(i):
        def emit(kind, value):
            if kind == "token" and i not in firsts:
                firsts[i] = time.perf_counter() - started
            elif kind in ("done", "error"):
                if kind == "error":
                    print(f"request {i} failed: {value!r}")
                done.release()
        return emit
    for i, prompt in enumerate(prompts):
        scheduler.submit(Request(key="bench", prompt=prompt, max_tokens=tokens, sampling=Sampling(temperature=0.0),
                                 seed=i, stop_ids=frozenset(), emit=emit_for(i)))
    for _ in prompts:
        done.acquire()
    return {"ttft": sorted(firsts.values()), "seconds": time.perf_counter() - started}


def run(model, clients: int, system: int, own: int, tokens: int, cache_bytes: int, every: int) -> dict:
    scheduler = Scheduler(model, max_sessions=clients, cache_bytes=cache_bytes, prefix_every=every)
    if model.device.type == "cuda":
        scheduler.warm_up()
    scheduler.start()
    try:
        asks = _asks(model.spec.vocab_size, clients + 2, system, own)
        cold = _submit(scheduler, asks[:1], tokens)
        crowd = _submit(scheduler, asks[1:clients + 1], tokens)
        after = _submit(scheduler, asks[clients + 1:], tokens)
    finally:
        scheduler.stop(drain_seconds=5)
    ttft = crowd["ttft"]
    return {"cold_ttft_s": cold["ttft"][0], "alone_after_ttft_s": after["ttft"][0],
            "clients_tokens_per_s": clients * tokens / crowd["seconds"],
            "clients_ttft_p50_s": ttft[len(ttft) // 2], "clients_ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "hits": scheduler.cache.hits, "saved_tokens": scheduler.cache.saved, "cache_bytes_held": scheduler.cache.used}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--mode", default="fast", choices=["fast", "exact"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--system", type=int, default=2000, help="system prompt tokens, shared (default 2000)")
    parser.add_argument("--own", type=int, default=64, help="each client's own prompt tokens (default 64)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a request (default 64)")
    parser.add_argument("--every", type=int, default=64, help="the cache keeps a state every K tokens (default 64)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    options = {"mode": args.mode}
    if args.device:
        options["device"] = args.device
    if args.dtype:
        options["dtype"] = getattr(torch, args.dtype)
    model = hebrus.load(args.model, **options)
    report = {"model": args.model, "mode": args.mode, "device": str(model.device), "clients": args.clients,
              "system": args.system, "own": args.own, "tokens": args.tokens, "every": args.every}
    for name, budget in (("off", 0), ("on", 1 << 30)):
        report[name] = run(model, args.clients, args.system, args.own, args.tokens, budget, args.every)
        print(name, json.dumps(report[name]), flush=True)
    on, off = report["on"], report["off"]
    report["cached_over_cold_ttft"] = on["alone_after_ttft_s"] / on["cold_ttft_s"]
    report["throughput_on_over_off"] = on["clients_tokens_per_s"] / off["clients_tokens_per_s"]
    print(f"cached TTFT / cold TTFT {report['cached_over_cold_ttft']:.3f}; clients' tokens/s with the cache "
          f"over without {report['throughput_on_over_off']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
