"""The engine loop and the HTTP front end in processes of their own (`hebrus serve`).

One interpreter cannot carry both at scale: on an H100 the engine loop alone delivered 8,801 to
9,700 tokens/s at 64 clients, and with the front end in its process 3,549, its steps 8.4 ms
where they took 5.5 and its prompt passes three times as long
(`benchmarks/results/cuda-h100/bd855bf`): the front end's Python (reading requests, shaping
every streamed token) holds the interpreter lock the engine's host work waits for. So the
engine stays in the process that loaded the model and the front end runs in a child process,
joined by a pipe:

- `Link` is the front end's engine: `submit` sends the requests' fields (a constraint as its
  grammar, started again beside the engine, off the relay's reading thread), a cancel is a
  message, `counts` asks and waits. A thread reads the engine's events and hands each to its
  request's `emit`.
- `Relay` is the engine's side: a thread reads the messages into `Scheduler.submit` and the
  requests' cancel events; a request's events wait in a list until the turn ends
  (`Scheduler.after_turn`), then go as one message: one send a turn, not one a token. Before
  a request's first event goes its count of prompt tokens found cached (the usage's).

Each side sends from a thread of its own (`_Writer`): no caller waits on a full pipe, and none
holds a lock while it does, so two sides each waiting for the other to read cannot happen. A
refusal for a full waiting line comes back as the requests' first events (`Overloaded` errors,
answered 429; one HTTP request's prompts are taken or refused together). When the engine's end
closes, what is running fails and later requests are refused (`EngineGone`, a 503). The front
end says when it is ready (`Relay.ready`): before then there is nothing to drain. `Face` is what
the front end needs of the model: its spec, family and checkpoint folder, its tokenizer made
from there.
"""
from __future__ import annotations

import functools
import itertools
import pickle
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

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


class EngineGone(RuntimeError):
    """The engine's end of the link has closed: the front end answers 503."""


class _Writer:
    """Messages sent on `conn` in the order put, by a thread of its own."""

    def __init__(self, conn, name: str):
        self.conn, self.queue = conn, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, message) -> None:
        self.queue.put(message)

    def close(self, seconds: float = 1.0) -> None:
        """Send what is queued (waiting up to `seconds`), then stop."""
        self.queue.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(seconds)

    def _run(self) -> None:
        while (message := self.queue.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError, EOFError):     # the other end is gone: nobody reads it
                return
            except Exception as exc:                    # noqa: BLE001 - one message lost, not the link
                print(f"hebrus serve: a {message[0]!r} message could not be sent: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)


class Link:
    """The engine as the front end's routes call it (`submit`, `counts`, `share_prefixes`), in
    another process at the end of `conn`. `lost`: called once the engine's end has closed
    (not when `close` closes this one)."""

    def __init__(self, conn, share_prefixes: bool, lost=None):
        self.conn, self.share_prefixes, self.on_lost = conn, share_prefixes, lost
        self.jobs: dict[int, Request] = {}      # every choice sent and not finished, by id
        self.asked: dict[int, list] = {}        # a `counts` waiting for its answer: [event, answer]
        self.lock = threading.Lock()            # `jobs`, `asked`, `gone`
        self.gone: BaseException | None = None  # set once the engine's end closed
        self.closing = False
        self.tokens = itertools.count()         # each `counts` question's own
        self.writer = _Writer(conn, "hebrus-link-send")
        self.thread = threading.Thread(target=_reading, args=(conn, self._take, self._lost, "from the engine"),
                                       name="hebrus-link", daemon=True)
        self.thread.start()

    def submit(self, *requests: Request) -> None:
        """Send `requests` (one HTTP request's prompts) and their copies (other choices) to the
        engine, taken or refused together; their events come to their `emit`s, a full waiting
        line as `Overloaded` error events. EngineGone once the engine's end has closed."""
        choices = [job for request in requests for job in (request, *request.copies)]
        for job in choices:
            job.cancelled = _Cancel(self, job.id)
        asks = [(r.id, {f: getattr(r, f) for f in FIELDS}, r.constraint.grammar if r.constraint is not None else None,
                 [(copy.id, copy.seed) for copy in r.copies]) for r in requests]
        with self.lock:
            if self.gone is not None:
                raise self._stopped()
            self.jobs.update((job.id, job) for job in choices)     # before its events can come
        self.writer.put(("submit", asks))

    def counts(self, timeout: float = 30.0) -> dict:
        """`Scheduler.counts` of the engine, asked for and waited for."""
        waiting = [threading.Event(), None]
        token = next(self.tokens)
        with self.lock:
            if self.gone is not None:
                raise self._stopped()
            self.asked[token] = waiting
        self.writer.put(("counts", token))
        if not waiting[0].wait(timeout):
            with self.lock:
                self.asked.pop(token, None)
            raise TimeoutError(f"the engine did not answer within {timeout:g} s")
        if waiting[1] is None:
            raise EngineGone(f"the engine could not answer: {self.gone or 'its counts failed'}")
        return waiting[1]

    def cancel(self, job_id: int) -> None:
        with self.lock:
            going = self.gone is None and job_id in self.jobs
        if going:
            self.writer.put(("cancel", job_id))

    def ready(self) -> None:
        """Tell the engine's end that the front end is serving."""
        self.writer.put(("ready",))

    def close(self) -> None:
        self.closing = True
        self.writer.close()
        self.conn.close()

    def _take(self, message) -> None:
        if message[0] == "events":
            for job_id, kind, value in message[1]:
                with self.lock:
                    job = self.jobs.pop(job_id, None) if kind in ("done", "error") else self.jobs.get(job_id)
                if job is None:
                    continue
                if kind == "cached":                    # the engine's count, which the usage reports
                    job.cached = value
                else:
                    job.emit(kind, value)
        elif message[0] == "counts":
            with self.lock:
                waiting = self.asked.pop(message[1], None)
            if waiting is not None:
                waiting[1] = message[2]
                waiting[0].set()

    def _stopped(self) -> EngineGone:
        return EngineGone(f"the engine stopped: {self.gone}")

    def _lost(self, exc: BaseException) -> None:
        """The engine's end closed: every request still running fails, later ones are refused."""
        with self.lock:
            self.gone = exc if str(exc) else EOFError("its end of the link closed")
            jobs, self.jobs = list(self.jobs.values()), {}
            asked, self.asked = list(self.asked.values()), {}
        for job in jobs:
            job.emit("error", self._stopped())
        for waiting in asked:
            waiting[0].set()                    # its answer None: the route fails
        if self.on_lost is not None and not self.closing:
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
        self.compiling: set[int] = set()        # requests not made yet: their grammars compiling
        self.early: set[int] = set()            # cancels for those
        self.events: list[tuple[int, str, object]] = []
        self.lock = threading.Lock()            # `jobs`, `compiling`, `early`, `events`
        self.ready = threading.Event()          # the front end is serving
        self.closed = False                     # the front end is gone: whatever is made now is cancelled
        self.writer = _Writer(conn, "hebrus-relay-send")
        self.grammars = ThreadPoolExecutor(1, thread_name_prefix="hebrus-grammar")
        scheduler.after_turn = self.flush
        self.thread = threading.Thread(target=_reading, args=(conn, self._take, self._closed, "from the front end"),
                                       name="hebrus-relay", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def flush(self) -> None:
        """Send the events put since the last flush, as one message (in the order they were put)."""
        with self.lock:
            events, self.events = self.events, []
            if events:
                self.writer.put(("events", events))

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

    def _closed(self, exc: BaseException) -> None:
        """The front end is gone: what it asked for is cancelled."""
        with self.lock:
            self.closed = True
            jobs = list(self.jobs.values())
        for job in jobs:
            job.cancelled.set()
        self.writer.close()
        self.grammars.shutdown(wait=False)

    def _take(self, message) -> None:
        if message[0] == "submit":
            if any(grammar is not None for _, _, grammar, _ in message[1]):
                with self.lock:
                    self.compiling.update(_ids(message[1]))
                self.grammars.submit(self._submit, message[1])      # compiling: off this thread
            else:
                self._submit(message[1])
        elif message[0] == "cancel":
            with self.lock:
                job = self.jobs.get(message[1])
                if job is None and message[1] in self.compiling:
                    self.early.add(message[1])
            if job is not None:
                job.cancelled.set()
        elif message[0] == "counts":
            try:
                counts = self.scheduler.counts()
            except Exception:                           # noqa: BLE001 - the route answers 503
                counts = None
            self.writer.put(("counts", message[1], counts))
        elif message[0] == "ready":
            self.ready.set()

    def _submit(self, asks: list) -> None:
        """The requests and their copies made here and submitted together; where that fails (a
        full waiting line, or anything else), each gets the error as its only event."""
        ids = _ids(asks)
        try:
            model, requests = self.scheduler.model, []
            for job_id, fields, grammar, copies in asks:
                constraint = grammar.start(model.tokenizer, model.spec.vocab_size) if grammar is not None else None
                request = Request(**fields, emit=self._emitter(job_id), constraint=constraint)
                request.copies = [Request(**(fields | {"seed": seed}), emit=self._emitter(i), constraint=constraint)
                                  for i, seed in copies]
                requests.append(request)
            with self.lock:
                made = [job for request in requests for job in (request, *request.copies)]
                self.jobs.update(zip(ids, made))
                for i, job in zip(ids, made):
                    if i in self.early or self.closed:
                        job.cancelled.set()
            self.scheduler.submit(*requests)
        except Exception as exc:                # noqa: BLE001 - they fail alone, as requests the loop fails
            for i in ids:
                self._emitter(i)("error", exc)
            self.flush()
        finally:
            with self.lock:
                self.compiling.difference_update(ids)
                self.early.difference_update(ids)


def _ids(asks: list) -> list[int]:
    """The front end's ids of a submit's requests and their copies, in order."""
    return [i for job_id, _, _, copies in asks for i in (job_id, *(c for c, _ in copies))]


def _reading(conn, take, closed, side: str) -> None:
    """Each message from `conn` to `take` until the other end closes, then `closed(exc)`; a
    message `take` fails on is said on stderr, not the end of the link."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError) as exc:
            closed(exc)
            return
        except Exception as exc:                        # noqa: BLE001 - one message unreadable, the rest still come
            print(f"hebrus serve: a message {side} could not be read: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            continue
        try:
            take(message)
        except Exception as exc:                        # noqa: BLE001 - a bad message, not a dead link
            print(f"hebrus serve: a {message[0]!r} message {side} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)


def _portable(exc: BaseException) -> BaseException:
    """`exc`, or where it cannot cross to another process, a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:                           # noqa: BLE001 - whatever pickling refuses
        return RuntimeError(f"{type(exc).__name__}: {exc}")
