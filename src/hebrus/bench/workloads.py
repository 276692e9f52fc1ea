"""`hebrus bench --serve --workload shared|mixed`: the server under two more workloads, each
run with the prefix cache on and off in one process (the ratios are side by side).

- `shared`: clients whose prompts share a system prompt (`--system` tokens) and differ in their
  last `--own` tokens, `--serve-tokens` new tokens each. One request alone first (cold: the cache
  is empty), then `--clients` at once, then one alone again (with the cache on, a hit). Reported:
  the TTFT of the requests alone (cached over cold), the clients' output tokens/s (on over off)
  and TTFT p50/p99, the cache's hit rate and the preemptions.
- `long`: `--clients` requests decoding `--serve-tokens` tokens each, and, once they all
  decode, one prompt of `--system` tokens arriving: the decoders' inter-token latency before it
  arrives (p50) and while it is fed (p99, up to its first token), and its TTFT. The prompt
  share of a turn is bounded in time (`prefill_share` steps alone) and tokens
  (`prefill_tokens`), so the decoders keep their pace.
- `chat`: `--clients` conversations of 4 turns, each turn's prompt the text so far (the last
  turn's prompt and reply) and a new user message, as a chat client sends it: output tokens/s,
  TTFT p50/p99 of the first turns and of the later ones, and the share of later turns' prompt
  tokens the cache spared (`cached_tokens`).
- `mixed`: `--requests` requests whose prompt and output lengths are drawn from lognormal
  distributions (medians `--serve-prompt` and `--serve-tokens`, σ 0.8, within the context),
  `--clients` in flight: output tokens/s, TTFT and ITL p50/p99.

The API key is set (the cache is per key), and every request uses it.
"""
from __future__ import annotations

import asyncio
import math
import time

import torch

from hebrus.bench.serve import _percentile, _settled, engine_from_now, load, prompts, serving, streamed

KEY = "bench"


CACHES = (("off", 0), ("on", 1 << 30))         # each workload's two runs: the prefix cache's budget


def _servers(model, name: str, max_sessions: int, report: dict, caches=CACHES, engine: dict | None = None):
    """For each (setting, cache budget) of `caches`, a server as `serving` makes it, with the API
    key set, the engine's options `engine` (`passes`, `prefill_share`, `prefill_tokens`, `prefill_chunk`: what the engine took goes
    in `report`), and one short request answered first (what a first request compiles or
    allocates) -> (the setting, its URL, its scheduler, its `ask`), each server stopped before
    the next."""
    for cache, budget in caches:
        with serving(model, name, api_key=KEY, max_sessions=max_sessions, cache_bytes=budget,
                     **(engine or {})) as running:
            url, scheduler, ask = running
            report["passes"], report["prefill_share"] = scheduler.passes, scheduler.prefill_share
            report["prefill_tokens"], report["server_start_s"] = scheduler.prefill_tokens, round(ask.started_s, 2)
            report["prefill_chunk"] = scheduler.chunk_size
            if budget:
                report["prefix_every"] = scheduler.cache.every
            ask(prompts(model.spec.vocab_size, 1, 8, seed=9), 1, 4, KEY)
            yield cache, url, scheduler, ask


def _measured(scheduler, run) -> dict:
    """`run()`'s report, with the prefix cache's hit rate and the preemptions while it ran, and
    where the engine thread spent its time (`engine`: seconds by part, its steps, and the graphs
    compiled meanwhile: a shape no warm-up met stalls every request)."""
    lookups, hits, preemptions = scheduler.cache.lookups, scheduler.cache.hits, scheduler.preemptions
    _settled(scheduler)
    engine = engine_from_now(scheduler)
    point = run()
    looked = scheduler.cache.lookups - lookups
    point["hit_rate"] = (scheduler.cache.hits - hits) / looked if looked else 0.0
    point["preemptions"] = scheduler.preemptions - preemptions
    point["engine"] = engine()
    return point


def _report(model, name: str, workload: str, **fields) -> dict:
    return {"workload": workload, "model": name, "device": str(model.device), "mode": model.mode, **fields}


def shared(model, name: str, clients: int, system: int, own: int, tokens: int, engine: dict | None = None) -> dict:
    gen = torch.Generator().manual_seed(3)
    common = torch.randint(0, model.spec.vocab_size, (system,), generator=gen).tolist()
    asks = [common + ids for ids in prompts(model.spec.vocab_size, clients + 2, own, seed=4)]
    report = _report(model, name, "shared", clients=clients, system=system, own=own, tokens=tokens)
    for cache, _, scheduler, ask in _servers(model, name, clients, report, engine=engine):
        report[cache] = {part: _measured(scheduler, lambda: ask(some, count, tokens, KEY))
                         for part, some, count in (("cold", asks[:1], 1), ("clients", asks[1:clients + 1], clients),
                                                   ("after", asks[clients + 1:], 1))}
    on, off = report["on"], report["off"]
    report["cached_over_cold_ttft"] = on["after"]["ttft_ms_p50"] / on["cold"]["ttft_ms_p50"]
    # against a cold request on a server without the cache: keeping states makes the cold one slower
    report["cached_over_cold_off_ttft"] = on["after"]["ttft_ms_p50"] / off["cold"]["ttft_ms_p50"]
    report["throughput_on_over_off"] = on["clients"]["output_tokens_per_s"] / off["clients"]["output_tokens_per_s"]
    return report


def long_prompt(model, name: str, clients: int, prompt: int, tokens: int, engine: dict | None = None) -> dict:
    vocab = model.spec.vocab_size
    decoders = prompts(vocab, clients, 16, seed=6)
    long = prompts(vocab, 1, prompt, seed=7)[0]
    report = _report(model, name, "long", clients=clients, prompt=prompt, tokens=tokens)
    for _, url, scheduler, ask in _servers(model, name, clients + 1, report, caches=(("off", 0),), engine=engine):
        # a tenth of the decoders' tokens first, then the long prompt
        report |= _measured(scheduler, lambda: ask.run(_long_here, url, name, decoders, tokens, long,
                                                       max(2, tokens // 10)))
    report["during_p99_over_before_p50"] = (report["itl_ms_p99_during"] / report["itl_ms_p50_before"]
                                           if report["itl_ms_p99_during"] and report["itl_ms_p50_before"] else None)
    return report


def _long_here(url: str, name: str, decoders: list[list[int]], tokens: int, long: list[int], before: int) -> dict:
    return asyncio.run(_long(url, name, decoders, tokens, long, before))


async def _long(url: str, name: str, decoders: list[list[int]], tokens: int, long: list[int], before: int) -> dict:
    """The decoders streaming; once they have made `before` gaps each, the long prompt sent."""
    gaps: list = []
    began = time.perf_counter()
    running = asyncio.ensure_future(load(url, name, decoders, len(decoders), tokens, KEY, timeline=gaps))
    while len(gaps) < before * len(decoders) and not running.done():
        await asyncio.sleep(0.005)
    sent = time.perf_counter() - began
    alone = await load(url, name, [long], 1, 1, KEY)
    answered = sent + alone["ttft_ms_p50"] / 1e3
    point = await running
    before_gaps = [gap for at, gap in gaps if at < sent]
    during = [gap for at, gap in gaps if sent <= at <= answered]
    return {"itl_ms_p50_before": _percentile(before_gaps, 0.5) * 1e3 if before_gaps else None,
            "itl_ms_p99_during": _percentile(during, 0.99) * 1e3 if during else None,
            "gaps_before": len(before_gaps), "gaps_during": len(during),
            # where the worst gaps while it is fed fall: (ms after it was sent, the gap in ms)
            "largest_gaps_during": [(round((at - sent) * 1e3, 1), round(gap * 1e3, 1)) for at, gap in
                                    sorted(((at, gap) for at, gap in gaps if sent <= at <= answered),
                                           key=lambda x: -x[1])[:12]],
            "long_ttft_ms": alone["ttft_ms_p50"], "decoders_tokens_per_s": point["output_tokens_per_s"]}


WORDS = ("the", "king", "of", "night", "shall", "come", "and", "we", "speak", "true", "love", "is", "not",
         "gold", "a", "storm", "upon", "sea", "my", "lord", "what", "light", "breaks", "there")


def chats(model, name: str, clients: int, opening: int, follow: int, tokens: int, turns: int = 4,
          engine: dict | None = None) -> dict:
    """Each conversation opens with about `opening` characters of text and adds about `follow`
    a turn (byte-level models: as many tokens)."""
    gen = torch.Generator().manual_seed(8)

    def text(chars: int) -> str:
        words = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(WORDS[int(torch.randint(len(WORDS), (1,), generator=gen))])
        return " ".join(words)
    openings = [text(opening) for _ in range(clients)]
    follows = [[" " + text(follow) for _ in range(turns - 1)] for _ in range(clients)]
    report = _report(model, name, "chat", clients=clients, turns=turns, opening=opening, follow=follow, tokens=tokens)
    for cache, url, scheduler, ask in _servers(model, name, clients, report, engine=engine):
        report[cache] = _measured(scheduler, lambda: ask.run(_chats_here, url, name, openings, follows, tokens))
    report["later_ttft_on_over_off"] = report["on"]["later_ttft_ms_p50"] / report["off"]["later_ttft_ms_p50"]
    return report


def _chats_here(url: str, name: str, openings: list[str], follows: list[list[str]], tokens: int) -> dict:
    return asyncio.run(_chats(url, name, openings, follows, tokens))


async def _chats(url: str, name: str, openings: list[str], follows: list[list[str]], tokens: int) -> dict:
    import httpx
    first_ttft, later_ttft, made, prompt_later, cached_later = [], [], 0, 0, 0

    async def conversation(client, opening: str, more: list[str]):
        nonlocal made, prompt_later, cached_later
        prompt = opening
        for turn in range(len(more) + 1):
            body = {"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            started, reply, first = time.perf_counter(), [], True
            async for event in streamed(client, url, body):
                if event.get("usage") and turn:
                    prompt_later += event["usage"]["prompt_tokens"]
                    cached_later += event["usage"]["prompt_tokens_details"]["cached_tokens"]
                if not event["choices"] or event["choices"][0]["finish_reason"] is not None:
                    continue
                if first:
                    (later_ttft if turn else first_ttft).append(time.perf_counter() - started)
                    first = False
                reply.append(event["choices"][0]["text"])
                made += 1
            if turn < len(more):
                prompt = prompt + "".join(reply) + more[turn]
    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {KEY}"},
                                 limits=httpx.Limits(max_connections=len(openings) + 4)) as client:
        await asyncio.gather(*(conversation(client, o, m) for o, m in zip(openings, follows)))
    wall = time.perf_counter() - began
    return {"output_tokens_per_s": made / wall, "wall_s": wall,
            "first_ttft_ms_p50": _percentile(first_ttft, 0.5) * 1e3,
            "later_ttft_ms_p50": _percentile(later_ttft, 0.5) * 1e3,
            "later_ttft_ms_p99": _percentile(later_ttft, 0.99) * 1e3,
            "later_cached_share": cached_later / prompt_later if prompt_later else 0.0}


def mixed(model, name: str, clients: int, requests: int, prompt: int, tokens: int, engine: dict | None = None) -> dict:
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
    report = _report(model, name, "mixed", clients=clients, requests=requests, prompt_median=prompt,
                     tokens_median=tokens, prompt_tokens=sum(p for p, _ in pairs), output_tokens=sum(counts))
    for cache, _, scheduler, ask in _servers(model, name, clients, report, engine=engine):
        report[cache] = _measured(scheduler, lambda: ask(asks, clients, counts, KEY))
    return report


def table(report: dict) -> str:
    if report["workload"] == "shared":
        lines = _head(report, "a shared system prompt",
                      f"{report['system']} system-prompt tokens shared, {report['own']} of each client's own, "
                      f"{report['tokens']} new tokens; {report['clients']} clients at once between two requests alone; "
                      f"the cache keeps a state every {report.get('prefix_every', '?')} tokens",
                      ["cold TTFT ms", "after TTFT ms", "clients tok/s", "clients TTFT p50 ms", "p99 ms",
                       "ITL p50 ms", "ITL p99 ms", "hit rate", "preemptions"])
        for cache in ("off", "on"):
            r = report[cache]
            c = r["clients"]
            lines.append(f"| {cache} | {r['cold']['ttft_ms_p50']:.1f} | {r['after']['ttft_ms_p50']:.1f} | "
                         f"{c['output_tokens_per_s']:.1f} | {c['ttft_ms_p50']:.1f} | {c['ttft_ms_p99']:.1f} | "
                         f"{_ms(c['itl_ms_p50'])} | {_ms(c['itl_ms_p99'])} | {c['hit_rate']:.2f} | {c['preemptions']} |")
        off_cold = report.get("cached_over_cold_off_ttft")
        lines += ["", f"cached TTFT ÷ cold TTFT (cache on): **{report['cached_over_cold_ttft']:.3f}**"
                      + ("" if off_cold is None else f"; ÷ a cold request's with the cache off: **{off_cold:.3f}**")
                      + f"; clients' tokens/s with the cache ÷ without: **{report['throughput_on_over_off']:.2f}×**"]
        return "\n".join(lines + _engines({f"{cache}, {part}": report[cache][part] for cache in ("off", "on")
                                            for part in ("cold", "clients", "after")})) + "\n"
    if report["workload"] == "chat":
        lines = _head(report, f"chats of {report['turns']} turns",
                      f"{report['clients']} conversations at once; ~{report['opening']} characters to open, "
                      f"~{report['follow']} more a turn, {report['tokens']} new tokens a turn",
                      ["output tok/s", "first turns' TTFT p50 ms", "later turns' TTFT p50 ms", "p99 ms",
                       "later prompts' tokens cached", "hit rate"])
        for cache in ("off", "on"):
            r = report[cache]
            lines.append(f"| {cache} | {r['output_tokens_per_s']:.1f} | {r['first_ttft_ms_p50']:.1f} | "
                         f"{r['later_ttft_ms_p50']:.1f} | {r['later_ttft_ms_p99']:.1f} | "
                         f"{r['later_cached_share']:.2f} | {r['hit_rate']:.2f} |")
        lines += ["", f"later turns' TTFT with the cache ÷ without: **{report['later_ttft_on_over_off']:.3f}**"]
        return "\n".join(lines + _engines({cache: report[cache] for cache in ("off", "on")})) + "\n"
    if report["workload"] == "long":
        ratio = report["during_p99_over_before_p50"]
        return "\n".join([
            f"# serving, a long prompt among decoders: {report['model']} on {report['device']} ({report['mode']})", "",
            f"{report['clients']} clients decoding {report['tokens']} tokens each; a {report['prompt']}-token prompt "
            f"arrives once they decode; {_passes(report['passes'])}, "
            f"prompt share {report['prefill_share']} (a turn within 1 + that many decode steps), "
            f"chunks of {report.get('prefill_chunk', '?')} tokens", "",
            "| decoders' ITL p50 before, ms | ITL p99 while it is fed, ms | ÷ | gaps before / during | "
            "its TTFT ms | decoders' tok/s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {_ms(report['itl_ms_p50_before'])} | {_ms(report['itl_ms_p99_during'])} | "
            f"{'–' if ratio is None else f'{ratio:.2f}'} | {report['gaps_before']} / {report['gaps_during']} | "
            f"{report['long_ttft_ms']:.1f} | {report['decoders_tokens_per_s']:.1f} |"] + _engines({"": report})) + "\n"
    lines = _head(report, "lognormal lengths",
                  f"{report['requests']} requests, {report['clients']} in flight; prompt median "
                  f"{report['prompt_median']}, output median {report['tokens_median']} (σ 0.8): "
                  f"{report['prompt_tokens']} prompt and {report['output_tokens']} output tokens in all",
                  ["output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "hit rate", "preemptions"])
    for cache in ("off", "on"):
        r = report[cache]
        lines.append(f"| {cache} | {r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | "
                     f"{_ms(r['itl_ms_p50'])} | {_ms(r['itl_ms_p99'])} | {r['hit_rate']:.2f} | {r['preemptions']} |")
    return "\n".join(lines + _engines({cache: report[cache] for cache in ("off", "on")})) + "\n"


def _head(report: dict, what: str, intro: str, columns: list[str]) -> list[str]:
    """A workload table's title, its line of what ran, and its header with a column per cache
    setting's figures."""
    return [f"# serving, {what}: {report['model']} on {report['device']} ({report['mode']})", "", intro, "",
            "| cache | " + " | ".join(columns) + " |", "| --- | " + " | ".join("---:" for _ in columns) + " |"]


def _engines(points: dict) -> list[str]:
    """Where the engine thread spent each point's time (seconds by part), its steps together,
    and the graphs compiled meanwhile, a line a point (`_measured`'s `engine`)."""
    lines = ["", "the engine thread, by point: seconds by part; steps together (replayed, not) and prompt passes begun (their tokens); graphs compiled", ""]
    for label, point in points.items():
        engine = point.get("engine")
        if engine is None:
            continue
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(engine["seconds"].items(), key=lambda kv: -kv[1]))
        steps = engine["steps"]
        counted = ", ".join(f"{steps[k]} {k}" + (f" in {steps[k + '_s']:.2f} s" if k + "_s" in steps else "")
                            for k in sorted(steps) if not k.endswith("_s"))
        lines.append(f"- {label + ': ' if label else ''}{parts or 'nothing'}; steps: {counted or 'none'}; "
                     f"compiled {engine['compiled']}")
    return lines


def _ms(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def _passes(passes: str) -> str:
    """How the engine ran a turn (`Scheduler.passes`), in words."""
    words = {"one": "one pass a turn", "two": "two passes a turn",
             "paced": "two passes a turn, the prompts' a few stages at a time"}
    return words.get(passes, passes)
