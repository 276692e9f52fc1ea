"""`hebrus bench --serve --workload shared|mixed`: the server under two more workloads, each
run with the prefix cache on and off in one process (the ratios are side by side).

- `shared`: clients whose prompts share a system prompt (`--system` tokens) and differ in their
  last `--own` tokens, `--serve-tokens` new tokens each. One request alone first (cold: the cache
  is empty), then `--clients` at once, then one alone again (with the cache on, a hit). Reported:
  the TTFT of the requests alone (cached over cold), the clients' output tokens/s (on over off)
  and TTFT p50/p99, the cache's hit rate and the preemptions.
- `mixed`: `--requests` requests whose prompt and output lengths are drawn from lognormal
  distributions (medians `--serve-prompt` and `--serve-tokens`, σ 0.8, within the context),
  `--clients` in flight: output tokens/s, TTFT and ITL p50/p99.

The API key is set (the cache is per key), and every request uses it.
"""
from __future__ import annotations

import math

import torch

from hebrus.bench.serve import prompts, serving

KEY = "bench"


def _point(url_scheduler_ask, asks, clients: int, tokens) -> dict:
    _, scheduler, ask = url_scheduler_ask
    lookups, hits, preemptions = scheduler.cache.lookups, scheduler.cache.hits, scheduler.preemptions
    point = ask(asks, clients, tokens, KEY)
    looked = scheduler.cache.lookups - lookups
    point["hit_rate"] = (scheduler.cache.hits - hits) / looked if looked else 0.0
    point["preemptions"] = scheduler.preemptions - preemptions
    return point


def shared(model, name: str, clients: int, system: int, own: int, tokens: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    common = torch.randint(0, model.spec.vocab_size, (system,), generator=gen).tolist()
    asks = [common + ids for ids in prompts(model.spec.vocab_size, clients + 2, own, seed=4)]
    warm = prompts(model.spec.vocab_size, 1, 8, seed=9)
    report = {"workload": "shared", "model": name, "device": str(model.device), "mode": model.mode,
              "clients": clients, "system": system, "own": own, "tokens": tokens}
    for cache, budget in (("off", 0), ("on", 1 << 30)):
        with serving(model, name, api_key=KEY, max_sessions=clients, cache_bytes=budget) as running:
            running[2](warm, 1, 4, KEY)
            report[cache] = {"cold": _point(running, asks[:1], 1, tokens),
                             "clients": _point(running, asks[1:clients + 1], clients, tokens),
                             "after": _point(running, asks[clients + 1:], 1, tokens)}
    on, off = report["on"], report["off"]
    report["cached_over_cold_ttft"] = on["after"]["ttft_ms_p50"] / on["cold"]["ttft_ms_p50"]
    report["throughput_on_over_off"] = on["clients"]["output_tokens_per_s"] / off["clients"]["output_tokens_per_s"]
    return report


def mixed(model, name: str, clients: int, requests: int, prompt: int, tokens: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    limit = model.spec.max_context

    def lengths(median: int) -> list[int]:
        drawn = torch.exp(math.log(median) + 0.8 * torch.randn(requests, generator=gen))
        return [max(1, int(n)) for n in drawn]
    pairs = [(min(p, limit - 2), t) for p, t in zip(lengths(prompt), lengths(tokens))]
    pairs = [(p, max(1, min(t, limit - p))) for p, t in pairs]
    vocab = model.spec.vocab_size
    asks = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in pairs]
    counts = [t for _, t in pairs]
    report = {"workload": "mixed", "model": name, "device": str(model.device), "mode": model.mode,
              "clients": clients, "requests": requests, "prompt_median": prompt, "tokens_median": tokens,
              "prompt_tokens": sum(p for p, _ in pairs), "output_tokens": sum(counts)}
    for cache, budget in (("off", 0), ("on", 1 << 30)):
        with serving(model, name, api_key=KEY, max_sessions=clients, cache_bytes=budget) as running:
            running[2](prompts(vocab, 1, 8, seed=9), 1, 4, KEY)
            report[cache] = _point(running, asks, clients, counts)
    return report


def table(report: dict) -> str:
    if report["workload"] == "shared":
        lines = [f"# serving, a shared system prompt: {report['model']} on {report['device']} ({report['mode']})", "",
                 f"{report['system']} system-prompt tokens shared, {report['own']} of each client's own, "
                 f"{report['tokens']} new tokens; {report['clients']} clients at once between two requests alone", "",
                 "| cache | cold TTFT ms | after TTFT ms | clients tok/s | clients TTFT p50 ms | p99 ms | "
                 "ITL p50 ms | ITL p99 ms | hit rate | preemptions |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for cache in ("off", "on"):
            r = report[cache]
            c = r["clients"]
            lines.append(f"| {cache} | {r['cold']['ttft_ms_p50']:.1f} | {r['after']['ttft_ms_p50']:.1f} | "
                         f"{c['output_tokens_per_s']:.1f} | {c['ttft_ms_p50']:.1f} | {c['ttft_ms_p99']:.1f} | "
                         f"{_ms(c['itl_ms_p50'])} | {_ms(c['itl_ms_p99'])} | {c['hit_rate']:.2f} | {c['preemptions']} |")
        lines += ["", f"cached TTFT ÷ cold TTFT (cache on): **{report['cached_over_cold_ttft']:.3f}**; clients' "
                      f"tokens/s with the cache ÷ without: **{report['throughput_on_over_off']:.2f}×**"]
        return "\n".join(lines) + "\n"
    lines = [f"# serving, lognormal lengths: {report['model']} on {report['device']} ({report['mode']})", "",
             f"{report['requests']} requests, {report['clients']} in flight; prompt median {report['prompt_median']}, "
             f"output median {report['tokens_median']} (σ 0.8): {report['prompt_tokens']} prompt and "
             f"{report['output_tokens']} output tokens in all", "",
             "| cache | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | hit rate | preemptions |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cache in ("off", "on"):
        r = report[cache]
        lines.append(f"| {cache} | {r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | "
                     f"{_ms(r['itl_ms_p50'])} | {_ms(r['itl_ms_p99'])} | {r['hit_rate']:.2f} | {r['preemptions']} |")
    return "\n".join(lines) + "\n"


def _ms(value) -> str:
    return "–" if value is None else f"{value:.1f}"
