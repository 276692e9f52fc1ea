"""`hebrus bench --serve`: the server under load against the same engine offline.

The server runs as `hebrus serve` runs it, its engine loop in this process and its HTTP front
end in another on a loopback port (`hebrus.serve.fronted`), and from a third process `clients` streaming requests at a time are kept in flight until `requests` have been answered,
each a prompt of `prompt` tokens and `tokens` new ones (greedy; no stop, so every request makes
all of them). Reported per concurrency: requests/s, output tokens/s, time to first token and
inter-token latency (p50, p99). Beside them, offline: the same number of sessions prefilled,
then decoding `tokens` steps together (`offline`), and the prefill of one prompt alone; the
ratios are server over offline, end to end (the same work a client waits for) and over the
decode steps alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Callable

import torch

from hebrus.bench.limits import sync
from hebrus.sampling import Sampling, sample_many


PREFILLS = 5                    # prefills timed offline at least: the median is the one to compare TTFT with


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def offline(model, batch: int, prompt: int, tokens: int, temperature: float = 0.0) -> dict:
    """The same work as `batch` requests, with no server: `batch` sessions prefilled one after
    another (chunks of 256, as the server feeds them), then decoding `tokens` steps together
    (a `Batch`: graphs on CUDA; one session after another in exact mode), each step's tokens
    chosen together as the server chooses them (`sample_many`: greedy, or at `temperature`
    from a generator each). Tokens/s end to end
    (prefill included, as a client sees it) and of the decode steps alone, and the median time
    of one prefill (of at least `PREFILLS`)."""
    from hebrus.batching import Batch
    sessions = [model.session(decode="eager") for _ in range(batch)]
    asks = prompts(model.spec.vocab_size, max(batch, PREFILLS), prompt, seed=1)
    sync(model.device)
    timed = []
    started = time.perf_counter()
    for s, ids in zip(sessions, asks):
        began = time.perf_counter()
        s.prefill(ids, 256)
        sync(model.device)
        timed.append(time.perf_counter() - began)
    prefilled = time.perf_counter()
    for ids in asks[batch:]:                    # a few more prefills timed, so a median means something
        began = time.perf_counter()
        model.session(decode="eager").prefill(ids, 256)
        sync(model.device)
        timed.append(time.perf_counter() - began)
    logits = [s.logits for s in sessions]
    sync(model.device)
    decoding = time.perf_counter()
    together = Batch(sessions) if model.kernels.whole_chunk else None
    how = [Sampling(temperature=temperature)] * batch
    generators = [torch.Generator().manual_seed(i) if temperature else None for i in range(batch)]
    for _ in range(tokens):
        chosen = sample_many(logits, how, generators)            # as the server chooses them
        failed = [c for c in chosen if isinstance(c, BaseException)]
        if failed:
            raise failed[0]
        if together is not None:
            logits = together.feed(chosen)
        else:
            logits = [s.feed([t]) for s, t in zip(sessions, chosen)]
    sync(model.device)
    ended = time.perf_counter()
    return {"batch": batch, "tokens_per_s": batch * tokens / (prefilled - started + ended - decoding),
            "decode_tokens_per_s": batch * tokens / (ended - decoding),
            "prefill_ms": _percentile(timed, 0.5) * 1e3}


async def streamed(client, url: str, body: dict):
    """The events of one streamed completion (`body`), parsed; RuntimeError when the server
    refuses it or fails it."""
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"the server answered {reply.status_code}: {await reply.aread()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed a request: {event['error']}")
            yield event


async def load(url: str, name: str, asks: list[list[int]], clients: int, tokens: int | list[int],
               key: str | None = None, timeline: list | None = None, temperature: float = 0.0) -> dict:
    """Keep `clients` streaming requests in flight until every prompt of `asks` is answered
    (`tokens` new ones each, or `tokens[i]` for ask i; greedy, or sampled at `temperature`
    from seed i), asked in order; their throughput
    and latencies. `timeline`: a list that gets each inter-token gap as it ends, (seconds from
    the start, the gap), while the load runs."""
    import httpx
    ttft, itl, made = [], [], 0
    counts = tokens if isinstance(tokens, list) else [tokens] * len(asks)
    queue = list(enumerate(zip(asks, counts)))[::-1]

    async def worker(client):
        nonlocal made
        while queue:
            i, (ids, wanted) = queue.pop()
            started = last = time.perf_counter()
            body = {"model": name, "prompt": ids, "max_tokens": wanted, "temperature": temperature, "stream": True}
            if temperature:
                body["seed"] = i
            first = True
            async for event in streamed(client, url, body):
                if not event["choices"] or event["choices"][0]["finish_reason"] is not None:
                    continue
                now = time.perf_counter()
                (ttft if first else itl).append(now - (started if first else last))
                if timeline is not None and not first:
                    timeline.append((now - began, now - last))
                first, last = False, now
                made += 1
    began = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with httpx.AsyncClient(timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=clients + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.perf_counter() - began
    return {"clients": clients, "requests": len(asks), "wall_s": wall, "requests_per_s": len(asks) / wall,
            "events_per_s": made / wall, "output_tokens_per_s": sum(counts) / wall,
            "ttft_ms_p50": _percentile(ttft, 0.5) * 1e3, "ttft_ms_p99": _percentile(ttft, 0.99) * 1e3,
            "itl_ms_p50": _percentile(itl, 0.5) * 1e3 if itl else None,
            "itl_ms_p99": _percentile(itl, 0.99) * 1e3 if itl else None}


def _load_here(url: str, name: str, asks: list[list[int]], clients: int, tokens, key: str | None = None,
               temperature: float = 0.0) -> dict:
    return asyncio.run(load(url, name, asks, clients, tokens, key, temperature=temperature))


@contextlib.contextmanager
def serving(model, name: str, api_key: str | None = None, **options):
    """A server of `model` as `hebrus serve` runs one: its engine loop in this process
    (`hebrus.serve.engine` with `options`), its HTTP front end in a process of its own on a
    loopback port (`hebrus.serve.fronted`), and another process for the clients (in this one
    they would share the interpreter lock with the engine) -> (its URL, its scheduler, a
    function `ask(asks, clients, tokens, key=None)` that runs `load` there; `ask.run(function,
    *args)` runs another function there; `ask.started_s`: seconds the server took to start).
    `api_key`: the key the server asks for (None: none)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import httpx

    from hebrus import serve
    began = time.perf_counter()
    scheduler = serve.engine(model, progress=lambda part: print(f"bench: warming the server up: {part}",
                                                                 file=sys.stderr, flush=True), **options)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listening.getsockname()[1]}"
    with serve.fronted(scheduler, name, listening, api_key, log_level="error") as front:
        listening.close()
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if not front.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server's front end did not start (exit status {front.exitcode})")
            time.sleep(0.05)
        started_s = time.perf_counter() - began             # the server's start (its warm-up on CUDA)
        clients_process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

        def ask(asks, clients: int, tokens, key: str | None = None, temperature: float = 0.0) -> dict:
            return clients_process.submit(_load_here, url, name, asks, clients, tokens, key, temperature).result()
        ask.run = lambda function, *args: clients_process.submit(function, *args).result()   # any load of the bench's
        ask.started_s = started_s
        try:
            yield url, scheduler, ask
        finally:
            clients_process.shutdown()


def run(model, name: str, concurrencies: list[int], requests: int, prompt: int, tokens: int,
        temperature: float = 0.0, engine: dict | None = None) -> dict:
    """`engine`: the engine's options (`passes`, `prefill_share`, `prefill_tokens`, `prefill_chunk`; the server's
    defaults where left out)."""
    points = []
    with serving(model, name, max_sessions=max(concurrencies), cache_bytes=0, **(engine or {})) as (url, scheduler, ask):
        passes, share, started, gather = scheduler.passes, scheduler.prefill_share, ask.started_s, scheduler.gather
        warm = prompts(model.spec.vocab_size, 2, prompt, seed=9)
        ask(warm, 1, 4)
        for clients in concurrencies:
            asks = prompts(model.spec.vocab_size, max(requests, clients), prompt, seed=clients)
            # offline once before the server too: what the server's run leaves warm (compiled
            # shapes, the allocator's blocks) must not be all on offline's side
            _settled(scheduler)
            first = offline(model, clients, prompt, tokens, temperature)
            scheduler.prefills.clear()
            engine = engine_from_now(scheduler)
            point = ask(asks, clients, tokens, temperature=temperature)
            point["engine"] = engine()
            # the same requests' prefills as the engine timed them: TTFT less this is what the
            # server adds (queueing, the loop, HTTP), paired within one run
            point["engine_prefill_ms_p50"] = _percentile(list(scheduler.prefills), 0.5) * 1e3
            point["ttft_minus_engine_prefill_ms"] = point["ttft_ms_p50"] - point["engine_prefill_ms_p50"]
            compiled = _compiled()
            _settled(scheduler)
            point["offline"] = offline(model, clients, prompt, tokens, temperature)
            point["offline"]["compiled"] = _compiled() - compiled
            point["offline_first"] = first
            point["throughput_over_offline"] = point["output_tokens_per_s"] / point["offline"]["tokens_per_s"]
            point["throughput_over_offline_decode"] = (point["output_tokens_per_s"]
                                                       / point["offline"]["decode_tokens_per_s"])
            point["ttft_minus_prefill_ms"] = point["ttft_ms_p50"] - point["offline"]["prefill_ms"]
            points.append(point)
    return {"model": name, "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
            "mode": model.mode, "prompt": prompt, "tokens": tokens, "temperature": temperature, "passes": passes,
            "prefill_share": share, "gather_ms": gather * 1e3, "prefill_tokens": scheduler.prefill_tokens,
            "prefill_chunk": scheduler.chunk_size, "server_start_s": round(started, 2),
            "points": points}


def _settled(scheduler, seconds: float = 60.0) -> None:
    """Wait until the idle engine has made its spare sessions: offline work must not share the
    model with the engine thread."""
    deadline = time.monotonic() + seconds
    while not scheduler.settled and time.monotonic() < deadline:
        time.sleep(0.01)


def engine_from_now(scheduler) -> Callable[[], dict]:
    """Start the idle engine's clocks and counts of steps from now -> a function giving where
    its thread spent the time since (seconds by part), its steps together, and the graphs the
    compiler made meanwhile."""
    scheduler.clock_reset()
    scheduler.timed.clear()
    compiled = _compiled()
    return lambda: {"seconds": {k: round(v, 4) for k, v in scheduler.spent.items()},
                    "steps": dict(scheduler.timed), "compiled": _compiled() - compiled}


def _prefill_cell(spent: dict, steps: dict) -> str:
    """A point's prompt passes in the engine table: their seconds (with one pass a turn, the
    turns that fed prompts beside the steps apart: their seconds are the steps' too) and how many."""
    beside = spent.get("one pass", 0)
    return (f"{spent.get('prefill', 0):.2f}" + (f" (+{beside:.2f} with steps)" if beside else "")
            + f" in {steps.get('prompt_passes', 0)}")


def _compiled() -> int:
    """Graphs the compiler has made in this process so far (fused ops: CUDA only)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def table(report: dict) -> str:
    lines = [f"# serving: {report['model']} on {report['device']} ({report['dtype']}, {report['mode']})", "",
             f"prompt {report['prompt']} tokens, {report['tokens']} new tokens per request "
             f"({'sampled at temperature ' + str(report['temperature']) if report.get('temperature') else 'greedy'}, "
             "streamed); "
             "offline: the same sessions prefilled, then decoding together; end to end includes the prefills; "
             f"a turn feeds at most {report.get('prefill_tokens', '?')} prompt tokens, "
             f"{report.get('prefill_chunk', '?')} a request; an idle engine gathers a burst of requests "
             f"arriving less than {report.get('gather_ms', float('nan')):g} ms apart; "
             f"the server started in {report.get('server_start_s', float('nan')):.1f} s (on CUDA its warm-up: "
             "every shape it serves compiled and captured)", "",
             "| clients | requests/s | output tok/s | offline tok/s | server ÷ offline | offline decode tok/s "
             "| server ÷ decode | TTFT p50 ms | TTFT p99 ms | prefill ms | engine prefill ms | TTFT − engine prefill "
             "| ITL p50 ms | ITL p99 ms |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in report["points"]:
        itl50 = "–" if p["itl_ms_p50"] is None else f"{p['itl_ms_p50']:.1f}"
        itl99 = "–" if p["itl_ms_p99"] is None else f"{p['itl_ms_p99']:.1f}"
        lines.append(f"| {p['clients']} | {p['requests_per_s']:.2f} | {p['output_tokens_per_s']:.1f} | "
                     f"{p['offline']['tokens_per_s']:.1f} | {p['throughput_over_offline']:.2f} | "
                     f"{p['offline']['decode_tokens_per_s']:.1f} | {p['throughput_over_offline_decode']:.2f} | "
                     f"{p['ttft_ms_p50']:.1f} | {p['ttft_ms_p99']:.1f} | {p['offline']['prefill_ms']:.1f} | "
                     f"{p['engine_prefill_ms_p50']:.1f} | {p['ttft_minus_engine_prefill_ms']:+.1f} | "
                     f"{itl50} | {itl99} |")
    lines += ["", "where the server's engine thread spent each point's wall time (seconds), its steps together "
              "(replayed from graphs, or not: uncaptured or captured), its prompt passes, and graphs compiled during the "
              "point; offline first: offline run once before the server (tok/s)", "",
              "| clients | wall | idle | admit | prefill (passes) | sample + send | replayed steps | steps not replayed | alone "
              "| finish | compiled (server / offline) | offline first tok/s |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in report["points"]:
        e = p.get("engine")
        if e is None:
            continue
        spent, steps = e["seconds"], e["steps"]
        lines.append(f"| {p['clients']} | {p['wall_s']:.2f} | {spent.get('idle', 0):.2f} | {spent.get('admit', 0):.2f} | "
                     f"{_prefill_cell(spent, steps)} | {spent.get('sample', 0):.2f} | "
                     f"{steps.get('replayed', 0)} in {steps.get('replayed_s', 0):.2f} | "
                     f"{steps.get('slow', 0)} in {steps.get('slow_s', 0):.2f} | {spent.get('alone', 0):.2f} | "
                     f"{spent.get('finish', 0):.2f} | "
                     f"{e['compiled']} / {p['offline']['compiled']} | {p['offline_first']['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"
