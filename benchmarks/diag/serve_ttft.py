"""Where the time to first token goes at one client: timestamps along one request's path, from
the client's send (another process; perf_counter is one clock across processes on Linux) to the
app, the engine's admission, its prefill, the token's emission, the response's first chunk and
the client's reading of it; medians over 24 sequential requests.

    python benchmarks/diag/serve_ttft.py [shakespeare | tiny | qwen3.5-1.7b]
"""
import asyncio
import os
import socket
import statistics
import sys
import threading
import time


def client(url, name, asks, tokens):
    import httpx
    out = []
    async def go():
        async with httpx.AsyncClient(timeout=600) as c:
            for ids in asks:
                body = {"model": name, "prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True}
                sent = time.perf_counter()
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    first = None
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and first is None:
                            first = time.perf_counter()
                out.append((sent, first))
    asyncio.run(go())
    return out


def main():
    import torch, hebrus
    from hebrus import serve
    from hebrus.serve import reply as reply_mod
    from hebrus.bench.serve import prompts
    import uvicorn
    name = sys.argv[1] if len(sys.argv) > 1 else "shakespeare"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("qwen3.5-1.7b",):
        from hebrus.bench import random_checkpoint
        from pathlib import Path
        model = hebrus.load(str(random_checkpoint(name, Path("/tmp/shapes") / name)), device=dev, dtype="bfloat16", mode="fast")
    else:
        model = hebrus.load(name, mode="fast", device=dev)
    marks = {}
    def mark(rid, what):
        marks.setdefault(rid, {})[what] = time.perf_counter()
    app, scheduler = serve.build(model, name, max_sessions=4, cache_bytes=0)
    S = type(scheduler)
    orig_submit, orig_admit, orig_prefill = S.submit, S._admit, S._prefill
    def submit(self, r):
        mark(r.id, "submit")
        emit = r.emit
        def wrapped(kind, value, r=r, emit=emit):
            if kind == "token" and "emit" not in marks.get(r.id, {}):
                mark(r.id, "emit")
            emit(kind, value)
        r.emit = wrapped
        return orig_submit(self, r)
    def admit(self, r):
        mark(r.id, "admit"); return orig_admit(self, r)
    def prefill(self, r):
        mark(r.id, "prefill0"); n = orig_prefill(self, r); mark(r.id, "prefill1"); return n
    S.submit, S._admit, S._prefill = submit, admit, prefill
    orig_stream = reply_mod.Reply.stream
    async def stream(self, first, events, include_usage, request):
        k = 0
        async for piece in orig_stream(self, first, events, include_usage, request):
            if k == 0:
                mark(self.job.id, "yield")
            k += 1
            yield piece
    reply_mod.Reply.stream = stream
    entries = []
    inner = app
    async def app(scope, receive, send):
        if scope["type"] == "http":
            entries.append(time.perf_counter())
        await inner(scope, receive, send)
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    asks = prompts(model.spec.vocab_size, 24, 128, seed=5)
    pool.submit(client, f"http://127.0.0.1:{port}", name, asks[:3], 2).result()
    marks.clear(); entries.clear()
    res = pool.submit(client, f"http://127.0.0.1:{port}", name, asks, 4).result()
    time.sleep(0.2)
    rows = [m for _, m in sorted(marks.items())]
    for m, e in zip(rows, entries):
        m["asgi"] = e
    steps = ["sent", "asgi", "submit", "admit", "prefill0", "prefill1", "emit", "yield", "first"]
    for (sent, first), m in zip(res, rows):
        m["sent"], m["first"] = sent, first
    print(name, dev)
    for a, b in zip(steps, steps[1:]):
        d = [(m[b] - m[a]) * 1e3 for m in rows if a in m and b in m]
        print(f"{a:>9} -> {b:<9} median {statistics.median(d):7.3f} ms  max {max(d):7.3f}")
    tot = [(m["first"] - m["sent"]) * 1e3 for m in rows]
    pre = [(m["prefill1"] - m["prefill0"]) * 1e3 for m in rows]
    print("ttft", round(statistics.median(tot), 3), "prefill", round(statistics.median(pre), 3))
    pool.shutdown(); server.should_exit = True; scheduler.stop(5)
    os._exit(0)


if __name__ == "__main__":
    main()
