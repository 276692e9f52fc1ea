"""`hebrus serve`: an OpenAI-compatible HTTP server where one failing request never touches
another. `app` holds the routes, `reply` shapes answers, `metrics` the Prometheus side; the engine loop they
feed is `hebrus.scheduling`.
Needs the `serve` extra (FastAPI, uvicorn, prometheus-client)."""
from __future__ import annotations

from hebrus.scheduling.scheduler import CHUNK_SIZE, PREFILL_SHARE


def build(model, name: str, api_key: str | None = None, max_sessions: int = 16, max_waiting: int = 256,
          cache_bytes: int = 1 << 30, max_body_bytes: int = 1 << 20, prefill_tokens: int | None = None,
          prefix_every: int = 64, share_prefixes: bool = False, prefill_share: float | None = PREFILL_SHARE, passes: str = "auto",
          prefill_chunk: int = CHUNK_SIZE, fault=None, progress=None):
    """(the FastAPI app, its scheduler, started) serving `model` as `name`. `prefill_tokens`:
    prompt tokens fed per turn of the engine loop at most (None: the model's `prefill_chunk`). `cache_bytes`: the
    prefix cache's budget (0: off); it keeps a state every `prefix_every` tokens of a prompt;
    `share_prefixes`: one cache space for every API key (else each key's own). `prefill_share`:
    while requests decode, a turn (its step and its prompt chunks) takes at most 1 + that many
    decode steps' time alone (None: `prefill_tokens` alone bounds the chunks). `passes`: a turn's prompt chunks and decode steps
    in "one" pass or "two", or "paced" (a pass of chunks a few stages a turn; "auto": two where the steps replay CUDA graphs). `prefill_chunk`: one
    request's prompt tokens a turn at most (`Scheduler`'s `chunk_size`). `fault` is for
    tests only: a function of a request returning a stage to fail its next step at, or None.
    `progress`: told each part of the warm-up on CUDA as it starts (`Scheduler.warm_up`)."""
    from hebrus.scheduling.scheduler import Scheduler
    from hebrus.serve.app import create_app
    from hebrus.serve.metrics import Metrics
    metrics = Metrics()
    scheduler = Scheduler(model, max_sessions=max_sessions, max_waiting=max_waiting, cache_bytes=cache_bytes,
                          chunk_size=prefill_chunk,
                          prefill_tokens=prefill_tokens, prefix_every=prefix_every, share_prefixes=share_prefixes,
                          prefill_share=prefill_share, passes=passes, fault=fault, metrics=metrics)
    if model.device.type == "cuda":
        # Fused ops compile on first use. Compiled in the engine thread, waiting on the
        # compiler's pool of worker processes never returned on the H200
        # (benchmarks/results/cuda-h200/test-cuda-serve-d00796d-hang.txt), and compiled
        # in-process each took over a second there, which every request waited for. So they
        # compile here, before serving, with the pool, for every shape the loop runs; whatever a
        # rare shape compiles later, in the engine thread, compiles in-process.
        scheduler.warm_up(progress)
        from hebrus.ops.cuda import fuse
        fuse.compile_in_process()
    app = create_app(model, name, scheduler, api_key=api_key, max_body_bytes=max_body_bytes,
                     metrics=metrics)
    scheduler.start()
    return app, scheduler


def run(model, name: str, listening, api_key: str | None, max_sessions: int, prefill_tokens: int | None = None,
        **options) -> None:
    """Serve on the socket `listening` (bound; it listens from here on) until SIGTERM or Ctrl-C; in-flight
    requests are finished first (up to 60 s), then this returns (the command exits 0). `options`:
    `build`'s others (the prefix cache, the prompt share, the passes)."""
    import contextlib
    import signal
    import sys

    import uvicorn

    host, port = listening.getsockname()[:2]
    address = f"[{host}]" if ":" in host else host

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):             # drain on the signal, then return (not die by it)
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(f"hebrus serve: ready, {name} at http://{address}:{port}/v1", file=sys.stderr, flush=True)

    if model.device.type == "cuda":
        print("hebrus serve: compiling the fused ops and capturing the steps before serving (minutes on a "
              "first start; the compiler's cache makes later starts quicker)", file=sys.stderr, flush=True)

    def progress(part: str) -> None:
        print(f"hebrus serve: warming up: {part}", file=sys.stderr, flush=True)
    app, scheduler = build(model, name, api_key=api_key, max_sessions=max_sessions, prefill_tokens=prefill_tokens,
                           progress=progress, **options)
    server = Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=60))
    try:
        server.run(sockets=[listening])         # returns once open requests have finished
    finally:
        scheduler.stop()
        listening.close()
