"""How many streamed token events a second the HTTP front end carries in the engine's own
interpreter. The server's app (routes, request shaping, the outbox, SSE) runs in this process
beside the engine, on a loopback port; the engine is a stand-in with the real one's rhythm: every
`--step-ms` it sends each running request (up to `--width`) its next token, then sleeps the
rest of the step (a GPU step waits on the device with the interpreter lock released). Clients
stream from `--client-processes` processes of their own. Reported: the events a second the
engine offered and the clients received, the engine's turns late against its step (the lock
it waited for), the server process's CPU seconds against the wall's (a server short of a core
is the limit; one with time to spare is not), and TTFT and ITL against the step.
`--host-ms`: the stand-in holds the interpreter lock for that much of each step, as the real engine's host work does; `--switch-ms`: the interpreter's
switch interval. (`hebrus serve` itself runs its front end in a process of its own since the
real engine, on an H100, lost most of its speed beside it: `benchmarks/README.md`.)

    python benchmarks/frontend_events.py --width 64 --step-ms 5 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import socket
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor


class PacedEngine:
    """Stands in for `Scheduler` where the app calls it: `submit`, `depth`, `start`, `stop`."""
    share_prefixes, preemptions, cache = False, 0, None

    def __init__(self, step_s: float, width: int, host_s: float = 0.0):
        self.step_s, self.width, self.host_s = step_s, width, host_s
        self.waiting, self.running = collections.deque(), []
        self.lock, self.stopped = threading.Lock(), False
        self.turns = self.late = self.sent = 0
        self.busy = 0.0                 # seconds the engine thread spent sending (the interpreter lock held)
        self.stepped = 0.0              # seconds of the turns that stepped, each from its start to its device wait
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def depth(self):
        return len(self.running), len(self.waiting)

    def submit(self, request) -> None:
        with self.lock:
            self.waiting.append(request)

    def start(self) -> None:
        self.thread.start()

    def stop(self, drain_seconds: float = 0) -> None:
        self.stopped = True
        self.thread.join(5)

    def _loop(self) -> None:
        due = time.perf_counter()
        while not self.stopped:
            began = time.perf_counter()
            with self.lock:
                while self.waiting and len(self.running) < self.width:
                    self.running.append(self.waiting.popleft())
            _hold(self.host_s)          # a step's own host work: launches, inputs, sampling (the lock held)
            for request in list(self.running):
                request.emit("token", 65 + len(request.produced) % 26)
                request.produced.append(0)
                self.sent += 1
                if len(request.produced) >= request.max_tokens:
                    request.emit("done", "length")
                    self.running.remove(request)
            now = time.perf_counter()
            self.busy += now - began
            if self.running:
                self.turns += 1
                self.stepped += now - began
                self.late += began > due + self.step_s / 2
            due = max(due + self.step_s, now)
            time.sleep(max(0.0, due - time.perf_counter()))


def _hold(seconds: float) -> None:
    """Busy in Python for `seconds`, holding the interpreter lock as the engine's host work does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(100))


def _clients(url: str, asks: list[list[int]], clients: int, tokens: int) -> dict:
    from hebrus.bench.serve import load
    return asyncio.run(load(url, "frontend", asks, clients, tokens))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=64, help="requests the engine steps at once (default 64)")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the engine's step (default 5 ms)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--requests", type=int, default=256, help="requests in all (default 256)")
    parser.add_argument("--client-processes", type=int, default=4, help="processes the clients run in (default 4)")
    parser.add_argument("--host-ms", type=float, default=0.0,
                        help="of each step, the engine's own host work in Python, the interpreter lock held "
                             "(default 0: the whole step waits on the device with the lock released)")
    parser.add_argument("--switch-ms", type=float, default=None,
                        help="the interpreter's switch interval (sys.setswitchinterval; default its own, 5 ms)")
    parser.add_argument("--json", default=None, help="write the report here too")
    args = parser.parse_args(argv)
    if args.width % args.client_processes or args.requests % args.client_processes:
        parser.error("--width and --requests must be multiples of --client-processes")

    import uvicorn

    import hebrus
    from hebrus.serve.app import create_app
    from hebrus.serve.metrics import Metrics
    model = hebrus.load("tiny")             # its tokenizer and limits only: the engine never runs it
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    engine = PacedEngine(args.step_ms / 1e3, args.width, args.host_ms / 1e3)
    app = create_app(model, "frontend", engine, metrics=Metrics())
    engine.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url, n = f"http://127.0.0.1:{port}", args.client_processes
    asks = [[1 + i % 50] * 8 for i in range(args.requests)]
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(_clients, url, asks[:n], n, 4).result()         # the processes start before the clock
        engine.turns = engine.late = engine.sent = 0
        engine.busy, engine.stepped, began, cpu = 0.0, 0.0, time.perf_counter(), time.process_time()
        parts = list(pool.map(_clients, [url] * n, [asks[i::n] for i in range(n)],
                              [args.width // n] * n, [args.tokens] * n))
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    server.should_exit = True
    engine.stop()
    received = args.requests * args.tokens
    report = {
        "width": args.width, "step_ms": args.step_ms, "tokens": args.tokens, "requests": args.requests,
        "client_processes": n, "cpus": multiprocessing.cpu_count(),
        "offered_events_per_s": args.width / (args.step_ms / 1e3),
        "received_events_per_s": received / wall,
        "engine_turns": engine.turns, "engine_turns_late": engine.late,
        "engine_busy_s": engine.busy, "wall_s": wall, "host_ms": args.host_ms,
        "switch_ms": args.switch_ms if args.switch_ms is not None else sys.getswitchinterval() * 1e3,
        "engine_host_ms_mean": engine.stepped / max(1, engine.turns) * 1e3,
        "server_cpu_s": cpu,            # the server's process (front end and engine): of wall_s, how busy
        "ttft_ms_p50": sorted(p["ttft_ms_p50"] for p in parts)[n // 2],
        "itl_ms_p50": sorted(p["itl_ms_p50"] for p in parts)[n // 2],
        "itl_ms_p99": max(p["itl_ms_p99"] for p in parts),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
