"""The engine loop and the HTTP front end in processes of their own (`hebrus serve`).

One interpreter cannot carry both at scale: on an H100 the engine loop alone delivered 8,801 to
9,700 tokens/s at 64 clients, and with the front end in its process 3,549, its steps 8.4 ms
where they took 5.5 and its prompt passes three times as long
(`benchmarks/results/cuda-h100/bd855bf`): the front end's Python (reading requests, shaping
every streamed token) holds the interpreter lock the engine's host work waits for. So the
engine stays in the process that loaded the model and the front end runs in a child process,
joined by a pipe:

- `Link` is the front end's engine: `submit` sends a request's fields (its constraint as its
  grammar, started again beside the engine), a cancel is a message, `counts` asks and waits.
  A thread reads the engine's events and hands each to its request's `emit`.
- `Relay` is the engine's side: a thread reads the messages into `Scheduler.submit` and the
  requests' cancel events; a request's events wait in a list until the turn ends
  (`Scheduler.after_turn`), then go as one message: one send a turn, not one a token. Before
  a request's first event goes its count of prompt tokens found cached (the usage's).

A refusal for a full waiting line comes back as the request's first event (an `Overloaded`
error, answered 429). `Face` is what the front end needs of the model: its spec, family and
checkpoint folder, its tokenizer made from there.
"""
from __future__ import annotations

import functools
import pickle
import threading

from hebrus.scheduling.scheduler import Request

FIELDS = ("key", "prompt", "max_tokens", "sampling", "seed", "stop_ids", "keep", "salt", "logprobs")


class Face:
    """The model as the front end sees it: no weights, its tokenizer from the checkpoint's folder."""

    def __init__(self, model):
        self.spec, self.family, self.source = model.spec, model.family, getattr(model, "source", None)

    @functools.cached_property
    def tokenizer(self):
        from hebrus.text.tokenizers import tokenizer_for
        return tokenizer_for(self)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "tokenizer"}


class Link:
    """The engine as the front end's routes call it (`submit`, `counts`, `share_prefixes`), in
    another process at the end of `conn`."""

    def __init__(self, conn, share_prefixes: bool, lost=None):
        self.conn, self.share_prefixes = conn, share_prefixes
        self.on_lost = lost                     # called once the engine's end has closed
        self.jobs: dict[int, Request] = {}      # every choice sent and not finished, by id
        self.lock = threading.Lock()            # `jobs`, `asked` and the sending end
        self.asked: dict[int, list] = {}        # a `counts` waiting for its answer: [event, answer]
        self.gone: BaseException | None = None  # set once the engine's end closed
        self.thread = threading.Thread(target=self._read, name="hebrus-link", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> None:
        """Send `request` and its copies (other choices) to the engine; their events come to
        their `emit`s, a full waiting line as an `Overloaded` error event."""
        choices = [request, *request.copies]
        for job in choices:
            job.cancelled = _Cancel(self, job.id)
        grammar = request.constraint.grammar if request.constraint is not None else None
        message = ("submit", request.id, {f: getattr(request, f) for f in FIELDS}, grammar,
                   [(copy.id, copy.seed) for copy in request.copies])
        with self.lock:
            if self.gone is not None:
                raise RuntimeError(f"the engine stopped: {self.gone}")
            self.jobs.update((job.id, job) for job in choices)
            self.conn.send(message)

    def counts(self, timeout: float = 30.0) -> dict:
        """`Scheduler.counts` of the engine, asked for and waited for."""
        waiting = [threading.Event(), None]
        with self.lock:
            if self.gone is not None:
                raise RuntimeError(f"the engine stopped: {self.gone}")
            token = id(waiting)
            self.asked[token] = waiting
            self.conn.send(("counts", token))
        if not waiting[0].wait(timeout):
            with self.lock:
                self.asked.pop(token, None)
            raise TimeoutError(f"the engine did not answer within {timeout:g} s")
        if waiting[1] is None:
            raise RuntimeError(f"the engine stopped: {self.gone}")
        return waiting[1]

    def cancel(self, job_id: int) -> None:
        with self.lock:
            if self.gone is None and job_id in self.jobs:
                self.conn.send(("cancel", job_id))

    def close(self) -> None:
        with self.lock:
            if self.gone is None:
                self.conn.close()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError) as exc:
                self._lost(exc)
                return
            if message[0] == "events":
                for job_id, kind, value in message[1]:
                    with self.lock:
                        job = self.jobs.pop(job_id) if kind in ("done", "error") else self.jobs.get(job_id)
                    if job is None:
                        continue
                    if kind == "cached":                # the engine's count, which the usage reports
                        job.cached = value
                    else:
                        job.emit(kind, value)
            elif message[0] == "counts":
                with self.lock:
                    waiting = self.asked.pop(message[1], None)
                if waiting is not None:
                    waiting[1] = message[2]
                    waiting[0].set()

    def _lost(self, exc: BaseException) -> None:
        """The engine's end closed: every request still running fails, later ones are refused."""
        with self.lock:
            self.gone = exc if str(exc) else EOFError("its end of the link closed")
            jobs, self.jobs = list(self.jobs.values()), {}
            asked, self.asked = list(self.asked.values()), {}
        for job in jobs:
            job.emit("error", RuntimeError(f"the engine stopped: {self.gone}"))
        for waiting in asked:
            waiting[0].set()                    # its answer None: the route fails
        if self.on_lost is not None:
            self.on_lost()


class _Cancel(threading.Event):
    """A front-end request's cancel event: setting it tells the engine."""

    def __init__(self, link: Link, job_id: int):
        super().__init__()
        self.link, self.job_id = link, job_id

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self.link.cancel(self.job_id)


class Relay:
    """The engine's end of the link: the front end's requests into `scheduler`, their events
    back a turn at a time (`Scheduler.after_turn`)."""

    def __init__(self, scheduler, conn):
        self.scheduler, self.conn = scheduler, conn
        self.jobs: dict[int, Request] = {}      # the front end's id -> the request here, until it ends
        self.events: list[tuple[int, str, object]] = []
        self.lock = threading.Lock()            # `jobs` and `events`
        self.sending = threading.Lock()         # one message on the pipe at a time
        scheduler.after_turn = self.flush
        self.thread = threading.Thread(target=self._read, name="hebrus-relay", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def flush(self) -> None:
        """Send the events put since the last flush, as one message (in the order they were put)."""
        with self.sending:
            with self.lock:
                events, self.events = self.events, []
            if events:
                self._sent(("events", events))

    def _send(self, message) -> None:
        with self.sending:
            self._sent(message)

    def _sent(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):           # the front end is gone: nobody is left to read it
            pass

    def _emitter(self, job_id: int):
        told = []

        def emit(kind: str, value) -> None:
            if kind == "error":
                value = _portable(value)
            with self.lock:
                job = self.jobs.get(job_id)
                if not told and job is not None:        # its prompt tokens found cached, before its first event
                    told.append(True)
                    self.events.append((job_id, "cached", job.cached))
                self.events.append((job_id, kind, value))
                if kind in ("done", "error"):
                    self.jobs.pop(job_id, None)
        return emit

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):         # the front end is gone: what it asked for is cancelled
                with self.lock:
                    jobs = list(self.jobs.values())
                for job in jobs:
                    job.cancelled.set()
                return
            if message[0] == "submit":
                self._submit(*message[1:])
            elif message[0] == "cancel":
                with self.lock:
                    job = self.jobs.get(message[1])
                if job is not None:
                    job.cancelled.set()
            elif message[0] == "counts":
                self._send(("counts", message[1], self.scheduler.counts()))

    def _submit(self, job_id: int, fields: dict, grammar, copies: list[tuple[int, int]]) -> None:
        """The request and its copies made here and submitted; where that fails (a full
        waiting line, or anything else), each gets the error as its only event."""
        ids = [job_id] + [i for i, _ in copies]
        try:
            model = self.scheduler.model
            constraint = grammar.start(model.tokenizer, model.spec.vocab_size) if grammar is not None else None
            request = Request(**fields, emit=self._emitter(job_id), constraint=constraint)
            request.copies = [Request(**(fields | {"seed": seed}), emit=self._emitter(i), constraint=constraint)
                              for i, seed in copies]
            with self.lock:
                self.jobs.update(zip(ids, [request, *request.copies]))
            self.scheduler.submit(request)
        except Exception as exc:                # noqa: BLE001 - it fails alone, as a request the loop fails
            for i in ids:
                self._emitter(i)("error", exc)
            self.flush()


def _portable(exc: BaseException) -> BaseException:
    """`exc`, or where it cannot cross to another process, a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:                           # noqa: BLE001 - whatever pickling refuses
        return RuntimeError(f"{type(exc).__name__}: {exc}")
