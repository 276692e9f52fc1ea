"""`hebrus serve`: an OpenAI-compatible HTTP server where one failing request never touches
another. `app` holds the routes, `reply` shapes answers, `metrics` the Prometheus side; the engine loop they
feed is `hebrus.scheduling`. `hebrus serve` runs the two in processes of their own (`link`, `fronted`);
`build` puts them in one (tests, a caller's own server).
Needs the `serve` extra (FastAPI, uvicorn, prometheus-client)."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

import uvicorn

from hebrus.scheduling.scheduler import CHUNK_SIZE, PREFILL_SHARE


def engine(model, max_sessions: int = 16, max_waiting: int = 256, cache_bytes: int = 1 << 30,
           prefill_tokens: int | None = None, prefix_every: int | None = None, share_prefixes: bool = False,
           prefill_share: float | None = PREFILL_SHARE, passes: str = "auto", prefill_chunk: int = CHUNK_SIZE,
           gather: float | None = None, fault=None, progress=None):
    """The engine loop serving `model` (a `Scheduler`, not started), warmed up on CUDA.
    `prefill_tokens`: prompt tokens fed per turn at most (None: the model's `prefill_chunk`).
    `cache_bytes`: the prefix cache's budget (0: off); it keeps a state every `prefix_every`
    tokens of a prompt (None: the scheduler's default for the model, 64 or 1024 on a GPU); `share_prefixes`: one cache space for every API key (else each key's
    own). `prefill_share`: while requests decode, a turn (its step and its prompt chunks) takes
    at most 1 + that many decode steps' time alone (None: `prefill_tokens` alone bounds the
    chunks). `passes`: a turn's prompt chunks and decode steps in "one" pass or "two", or
    "paced" (a pass of chunks a few stages a turn; "auto": two where the steps replay CUDA
    graphs). `prefill_chunk`: one request's prompt tokens a turn (more for the oldest while
    no request decodes: `Scheduler`'s `chunk_size`). `gather`: seconds an idle loop waits for more of a burst of requests
    (`Scheduler.gather`; None: its default). `fault` is for tests only: a function of a request returning a stage to fail
    its next step at, or None. `progress`: told each part of the warm-up on CUDA as it starts
    (`Scheduler.warm_up`)."""
    from hebrus.scheduling.scheduler import Scheduler
    scheduler = Scheduler(model, max_sessions=max_sessions, max_waiting=max_waiting, cache_bytes=cache_bytes,
                          chunk_size=prefill_chunk, prefill_tokens=prefill_tokens, prefix_every=prefix_every,
                          share_prefixes=share_prefixes, prefill_share=prefill_share, passes=passes, gather=gather,
                          fault=fault)
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
    return scheduler


def build(model, name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20, **options):
    """(the FastAPI app, its scheduler, started) serving `model` as `name`, both in this process;
    `options`: `engine`'s."""
    from hebrus.serve.app import create_app
    scheduler = engine(model, **options)
    app = create_app(model, name, scheduler, api_key=api_key, max_body_bytes=max_body_bytes)
    scheduler.start()
    return app, scheduler


@contextlib.contextmanager
def fronted(scheduler, name: str, listening, api_key: str | None = None, max_body_bytes: int = 1 << 20,
            log_level: str = "info", drain_seconds: float = 60.0):
    """`scheduler` started here and the HTTP front end serving its model as `name` on the
    socket `listening` (bound; it listens from there on) in a process of its own, the two joined
    by `link`; yields that process, its `ready` set once it serves (a signal before then ends it
    as the default would: it has nothing to drain). On leaving, or where the front end cannot be
    started, the front end is told to stop (SIGTERM: open requests finish first, up to
    `drain_seconds`) and waited for, then the loop stops."""
    import multiprocessing

    from hebrus.serve.link import Face, Relay
    spawn = multiprocessing.get_context("spawn")    # (a fork would copy CUDA's state and the threads' locks)
    here, there = spawn.Pipe()
    relay = Relay(scheduler, here)
    front = spawn.Process(target=_front, name="hebrus-http", args=(
        there, listening, Face(scheduler.model), name, api_key, max_body_bytes, scheduler.share_prefixes,
        log_level, drain_seconds))
    relay.start()
    scheduler.start()
    try:
        try:
            with _deaf_children():
                front.start()
        finally:
            there.close()
        front.ready = relay.ready
        yield front
    finally:
        if front.is_alive():
            front.terminate()
        if front.pid is not None:
            front.join()
        here.close()
        scheduler.stop(drain_seconds=5)


@contextlib.contextmanager
def _deaf_children():
    """Processes started inside hold Ctrl-C back until they set handlers of their own (the front
    end does as it starts serving, `_Server.capture_signals`): one that arrives while they import
    is this process's to act on (`run` ends a front end still starting), not a traceback of
    theirs. The signal is blocked in this thread meanwhile (a child starts with its parent's
    mask), not ignored: this process's other threads still take it, so none is lost. Only the
    main thread's mask matters to a Ctrl-C; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # (multiprocessing's resource tracker, started by the first process a process spawns, unblocks
    # SIGINT once it is started: started first, it leaves the mask alone)
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def run(model, name: str, listening, api_key: str | None, max_sessions: int, prefill_tokens: int | None = None,
        **options) -> int:
    """Serve on the socket `listening` (bound) until SIGTERM or Ctrl-C; in-flight requests are
    finished first (up to 60 s), then this returns 0 (the command's exit status; 1 where the
    front end ended of itself, failing). The engine loop runs in this process, the HTTP front end
    in a child (`fronted`). `options`: `engine`'s others (the prefix cache, the prompt share,
    the passes)."""
    if model.device.type == "cuda":
        print("hebrus serve: compiling the fused ops and capturing the steps before serving (minutes on a "
              "first start; the compiler's cache makes later starts quicker)", file=sys.stderr, flush=True)

    def progress(part: str) -> None:
        print(f"hebrus serve: warming up: {part}", file=sys.stderr, flush=True)
    scheduler = engine(model, max_sessions=max_sessions, prefill_tokens=prefill_tokens, progress=progress, **options)
    told, started = [], []

    def tell(signum, frame):                # the front end drains, then ends; this waits for it
        if told:
            return
        told.append(signum)
        if started:
            stop(started[0])

    def stop(front):
        if not front.is_alive():
            return
        if front.ready.is_set():
            front.terminate()
        else:                               # still starting: nothing to drain
            front.kill()
    previous = {sig: signal.signal(sig, tell) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with fronted(scheduler, name, listening, api_key) as front:
            listening.close()               # the front end's now
            started.append(front)
            if told:                        # told while it was being started
                stop(front)
            front.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # told: ended by the signal we sent (killed while starting) or by Ctrl-C, which reaches both
    stopped = told and front.exitcode in (-signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL)
    if front.exitcode != 0 and not stopped:
        print(f"hebrus serve: error: the HTTP front end ended with exit status {front.exitcode}",
              file=sys.stderr, flush=True)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, draining on SIGINT or SIGTERM and returning (not dying by it), saying
    when it is ready."""

    def __init__(self, config, ready: str, link=None):
        super().__init__(config)
        self.ready, self.link = ready, link

    @contextlib.contextmanager
    def capture_signals(self):
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)     # held back while starting (`_deaf_children`)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            print(self.ready, file=sys.stderr, flush=True)
            if self.link is not None:
                self.link.ready()


def _front(conn, listening, face, name: str, api_key, max_body_bytes: int, share_prefixes: bool, log_level: str,
           drain_seconds: float) -> None:
    """The front end's process: the app over a `Link` to the engine, served until told to stop
    or until the engine's end of the link closes."""
    import os

    from hebrus.serve.app import create_app
    from hebrus.serve.link import Link
    host, port = listening.getsockname()[:2]
    address = f"[{host}]" if ":" in host else host
    link = Link(conn, share_prefixes, lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    app = create_app(face, name, link, api_key=api_key, max_body_bytes=max_body_bytes)
    server = _Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_seconds),
                     f"hebrus serve: ready, {name} at http://{address}:{port}/v1", link)
    try:
        server.run(sockets=[listening])         # returns once open requests have finished
    finally:
        link.close()
        listening.close()
