"""The serving engine loop: one thread owns the model and runs every request's transactions. It
knows nothing of HTTP (`hebrus.serve` turns requests into `Request`s and events into answers).

Each turn of the loop admits waiting requests (up to `max_sessions` running), feeds prompt
chunks of requests still prefilling, oldest request first, up to `prefill_tokens` tokens a turn
(at least one chunk, so a long prompt cannot stall: this budget never cuts a chunk of
`chunk_size`). A request's chunk is `chunk_size` tokens at most; while no request decodes (no
step waits for the pass), what the budget has left after every prompt's chunk goes to the
oldest, as much as each takes (on a GPU a pass costs the host about as much at any size: a
2,064-token prompt alone took nine passes of 256 and 0.8 s on an H100), where its chunk keeps
states for the prefix cache no more than the cache holds. With
`prefill_share` and requests decoding, fewer, cut to fit: as many as keep the turn within 1 +
that many decode steps' time, both measured, so that a long prompt does not stall the decoders'
pace (a bound in measured time, not tokens: a token costs more deep in a long context), but at least MIN_CHUNK
and at least the prefilling requests' part of `prefill_tokens` by head count (one decoder does
not hold fifteen waiting prompts to a trickle). Every request that is decoding steps once a turn.
In fast mode a turn is one pass (`passes="one"`): the decoding requests' next tokens and the
prompt chunks together, each request its own transaction; a request whose prompt that pass
completes chooses and sends its first token at once, and steps it next turn. With CUDA graphs
(`passes="two"`, the default there) the chunks go in one pass and the steps of every request
then decoding in a second, replayed from the model's graphs, which any set of sessions shares
(a pass of chunks and steps together would not replay). With `passes="paced"` the steps
go in a pass of their own, as with two, but a pass of chunks runs only a few of its stages a
turn (`engine.paced`: it waits between stages on a stack of its own), as many as
`prefill_share` decode steps' time affords at the seconds a stage has taken, so a turn stays
within 1 + `prefill_share` steps however long the pass (on a GPU a pass of any size costs the
host tens of milliseconds, which no cut in its tokens brings near a replayed step). One such
pass is under way at a time; its requests are neither dropped nor preempted until it ends, and
its chunks are not cut to the share. Exact mode feeds and steps them one after another. A transaction that aborts fails its own request only: its session
publishes nothing, and every other request goes on as if it had never been there. A request
samples from its own generator, so what it produces does not depend on what runs beside it
(exact mode: bit for bit what `Session.generate` gives).

While it has nothing to do, the loop makes up to `spare_sessions` new sessions (by default as
many as `max_sessions`: a burst of requests after a quiet spell is admitted without making one),
so that admitting a request takes one instead of waiting for one to be made. A spare holds a
slot of the state pool and no block, and gives it back first wherever the loop needs one: a
fork for a cached prefix or a request's copy, a preempted request coming back, and the states a
turn's prompt chunks keep for the prefix cache (spares are let go until the pool has a slot for
each).

Admission is first come, first served, with a share per API key: while requests of several keys
wait or run, a key that holds its share of the `max_sessions` places (an equal part, at least
one) lets a later request of another key go first, so one busy key cannot starve the others. A
request of n choices takes n places, waiting and running (its copies are made when its prompt
is fed); one larger than the places runs when nothing else does.

When a chunk finds the state pool without a free block (`PoolExhausted`), the loop makes room and
the chunk runs again next turn: the prefix cache gives back its least recently used entries
first; else the newest running request is preempted (`scheduling.preemption`: its state to host
memory, up to `preempt_host_bytes` for all of them, else recomputed from its tokens when it comes
back). Preempted requests come back, oldest first and before any new request, once the pool has
blocks for their rows and a step more; what they produce is unchanged by it (exact mode: bit for
bit). Only a request that holds the pool alone fails.

The prefix cache (`PrefixCache`) keeps states as prompts are fed: every `prefix_every` tokens
(by default 64, or 1024 where a prompt pass costs the host about the same at any length: `_every`),
at each prompt's end, where a prompt left a cached one, and at the end of every finished turn. A
later request whose prompt begins with cached tokens forks the nearest state kept at or below
where they part and feeds only the rest; its `cached` says how many tokens it was spared. A
request sees only its own space's entries: its API key's (and `cache_salt`'s), or every key's
when `share_prefixes` is on. The chunks of a turn that keep states are fed with the others in one
pass (`feed_keeping_many`).
"""
from __future__ import annotations

import collections
import gc
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hebrus import faults
from hebrus.errors import AllocationError, ChunkAborted, PoolExhausted
from hebrus.sampling import Sampling
from hebrus.batching import Batch, feed_keeping_many, feed_many
from hebrus.engine.graphs import decode_route, lanes_for
from hebrus.engine.paced import Paced
from hebrus.scheduling import choice
from hebrus.scheduling.pace import Pace
from hebrus.scheduling.preemption import Preempted
from hebrus.scheduling.prefix import PrefixCache
from hebrus.state.constraint import ahead
from hebrus.uploads import upload


@dataclass
class Request:
    """One completion: what to feed and how to sample, and where its events go. `emit(kind,
    value)` is called from the engine thread: ("token", id), ("logprobs", scores), ("done",
    finish reason) or ("error", exception); `serve.link`'s relay also calls it, from its own
    thread, for a request it could not submit."""
    key: str                            # the API key that owns what the request leaves cached
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    stop_ids: frozenset[int]
    emit: Callable[[str, object], None]
    keep: bool = True                   # cache the states its prompt and conversation pass
    salt: str = ""                      # narrows the prefix cache's space (a request's `cache_salt`)
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # engine-side state
    session: object = None
    cached: int = 0                     # prompt tokens found cached
    cut: int = 0                        # where its prompt left the cached tokens (a state is kept there)
    fed: int = 0                        # prompt tokens fed so far (cached ones included)
    logits: torch.Tensor | None = None
    produced: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None    # the ids a repetition penalty counts (prompt and output), as a mask
    counts: torch.Tensor | None = None  # each id's count in the output, for presence and frequency penalties
    admitted_at: float = 0.0
    prefill_s: float = 0.0              # seconds its prompt chunks took to feed
    pending: int | None = None          # a token chosen and sent whose step is still to run
    host: object = None                 # its state in host memory while preempted (None: recompute)
    # what its output must match (`state.constraint`): its session is constrained by it once its
    # prompt is fed, before its first token is chosen (`constrained` from then on)
    constraint: object = None
    constrained: bool = False
    # the request's other choices (n > 1): each gets a fork of its session once its prompt is
    # fed, and samples from its own generator (its own seed) from there on
    copies: list["Request"] = field(default_factory=list)
    logprobs: int | None = None         # send each token's log probability and this many likeliest ones'


# an idle loop's wait for more of a burst of requests (`Scheduler.gather`): while they keep
# arriving less than `gather` apart, up to GATHER_TIMES that in all. Off unless asked: on an H100
# at 83455c0, 64 clients made 5,445 tokens/s gathering 5 ms apart against 6,089 without, idle
# 0.18 s against 0.08 and no less time in prompt passes (one run each, one after the other)
GATHER_TIMES = 10

# a turn's prompt work while requests decode, in decode steps alone (`hebrus serve --prefill-share`):
# a long prompt then slows the decoders' tokens about 1 + this many times
PREFILL_SHARE = 1.5
CHUNK_SIZE = 256        # one request's prompt tokens a turn at most (`hebrus serve --prefill-chunk`)
WARM_UP = "\0warm-up"    # the made-up requests' key (`Scheduler.warm_up`)
MIN_CHUNK = 16          # prompt tokens a turn feeds at least, however slow prefill is against a step


@dataclass
class Flight:
    """A prompt pass under way across turns (`passes="paced"`): its chunks, where they keep
    states and the dict the kept sessions go in, the pass, and when it began."""
    feeding: list[tuple[Request, list[int]]]
    marked: dict
    kept: dict
    paced: Paced
    began: float                        # when (`time.perf_counter`): its requests' prefill time runs from here


class Overloaded(Exception):
    """The waiting line is full: the caller answers 429 with Retry-After."""


class Scheduler:
    def __init__(self, model, max_sessions: int = 16, max_waiting: int = 256, chunk_size: int = CHUNK_SIZE,
                 prefill_tokens: int | None = None, cache_bytes: int = 1 << 30, cache_per_key: int | None = None,
                 prefix_every: int | None = None, share_prefixes: bool = False, spare_sessions: int | None = None, decode: str = "auto",
                 preempt_host_bytes: int = 4 << 30, prefill_share: float | None = None, passes: str = "auto",
                 gather: float | None = None, fault: Callable[[Request], str | None] | None = None):
        spare_sessions = max_sessions if spare_sessions is None else spare_sessions
        if spare_sessions < 0:
            raise ValueError(f"spare_sessions must be at least 0, got {spare_sessions}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.model, self.max_sessions, self.max_waiting = model, max_sessions, max_waiting
        # new sessions made while the loop is idle, so that admitting a request does not wait
        # for one to be made (on a GPU, allocating its banks takes milliseconds)
        self.spare_sessions, self.spares = spare_sessions, []
        self._spares_refused = False    # making one failed: none is made until a request is admitted
        # None: the model's prefill chunk (8192 tokens in fast mode on a GPU, where a pass of a
        # few hundred tokens costs the host about what one of thousands does; 512 elsewhere)
        self.chunk_size = chunk_size
        self.prefill_tokens = model.prefill_chunk if prefill_tokens is None else prefill_tokens
        # with requests decoding, a turn takes at most 1 + `prefill_share` decode steps' time
        # (None: `prefill_tokens` alone bounds its chunks); seconds per prompt token and per
        # decode step fitted to the passes as they run (`Pace`)
        if prefill_share is not None and not prefill_share > 0:
            raise ValueError(f"prefill_share must be positive, got {prefill_share}")
        self.prefill_share, self.pace = prefill_share, Pace()
        # the route of the decoding requests' steps together in fast mode (`decode_route`: "auto"
        # is graphs on CUDA; eager over tensor-parallel ranks); exact mode steps them one after another
        self.decode = decode_route(model, decode)
        # "one": a turn that feeds prompt chunks steps the decoding requests in the same pass;
        # "two": in a pass of their own after it, from the static step plan where `decode` is
        # "planned" or "graph" (a pass of chunks and steps together is eager); "paced": as
        # two, the pass of chunks a few stages a turn (`_fly`); "auto": two where the steps
        # take the plan, else one
        if passes not in ("one", "two", "paced", "auto"):
            raise ValueError(f"passes must be 'one', 'two', 'paced' or 'auto', got {passes!r}")
        self.passes = passes if passes != "auto" else "two" if self.decode in ("planned", "graph") else "one"
        if self.passes == "paced" and prefill_share is None:
            raise ValueError("passes='paced' runs as many of a prompt pass's stages a turn as prefill_share decode "
                             "steps' time affords: give a prefill_share")
        if self.passes == "paced" and getattr(model, "ranks", None) is not None:
            raise ValueError("passes='paced' stops a prompt pass between its stages: a model over "
                             "tensor-parallel ranks steps only in calls every rank runs; use 'one' or 'two'")
        self.flight: Flight | None = None           # the paced prompt pass under way
        # an idle loop that a request wakes waits for more while they keep arriving less than
        # `gather` seconds apart (up to GATHER_TIMES that in all), so a burst's prompts go in one
        # pass, not one pass for the first few and another for the rest (None: 0, see GATHER_TIMES)
        if gather is not None and not gather >= 0:
            raise ValueError(f"gather must be at least 0 seconds, got {gather}")
        self.gather = 0.0 if gather is None else gather
        self._arrived = 0.0             # when the last request was submitted (`time.perf_counter`)
        self.widest = 0                 # the most requests one step has stepped together (tests, bench)
        # steps together and their seconds, replayed from graphs or not (bench): "replayed",
        # "replayed_s", "slow", "slow_s"; passes of prompt chunks begun and their tokens:
        # "prompt_passes", "prompt_tokens"
        self.timed: collections.Counter[str] = collections.Counter()
        self.prefills: collections.deque[float] = collections.deque(maxlen=4096)   # seconds per prompt fed (bench)
        # where the engine thread's time goes (bench): seconds idle (making spare sessions
        # included), admitting, feeding prompts, sampling and sending tokens, stepping together,
        # stepping alone, and the rest of a turn
        self.spent: collections.Counter[str] = collections.Counter()
        self._idle_since = time.perf_counter()
        # a key keeps at most a quarter of the budget beside other keys' entries unless told
        # otherwise, whatever salts its requests carry: one busy key cannot evict every other
        # key's prefixes (alone, it may fill it). Its spaces (`_space`) count against the key;
        # shared, each salt's space against itself (`cache_per_key` bounds a salt's then)
        self.cache = PrefixCache(cache_bytes, _every(model) if prefix_every is None else prefix_every,
                                 cache_bytes // 4 if cache_per_key is None and not share_prefixes else cache_per_key,
                                 holder=None if share_prefixes else (lambda space: space[0]))
        self.share_prefixes = share_prefixes
        self.fault = fault              # tests only: a stage to fail a request's next step at
        # transactions aborted, by (failure kind, stage) (/metrics; made-up requests not counted)
        self.aborts: collections.Counter[tuple[str, str]] = collections.Counter()
        # called by the engine thread after each turn and once more as the loop ends: where the
        # turn's events go on together (`serve.link`)
        self.after_turn: Callable[[], None] | None = None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preempted = Preempted(preempt_host_bytes)
        self._wake = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="hebrus-engine", daemon=True)

    # ---- what the HTTP side calls (any thread) ---------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Before `start`, serve made-up requests in the caller's thread, through the loop's own
        turns, so that every shape serving runs is met here first: a fused op compiles for each
        power of two of rows a decode step's lanes meet, once for a prompt's any rows (twice
        more: for rows fewer than a conv's taps, and for one; `ops.cuda.fuse`), and a step's
        graph is captured for each width; met first while serving, each stalled every request
        (42 compiles, 59 s, at 64 clients on an H100). A pass of several sessions runs some ops
        on each session's rows and others on all of them, so the waves are: a prompt of every
        power of two of tokens up to `chunk_size` (and of 3 and 9), alone and two at a time;
        prompts of the longest such chunk together, up to a turn's `prefill_tokens` rounded up
        to a power of two (and `max_sessions` of them); then, for every lane width up to `max_sessions`, that many
        requests decoding together (three steps or more: uncaptured, captured, replayed); a
        prompt beside a decoding request. Each made-up prompt is its own (none is found cached);
        their cached prefixes are dropped after, the loop's counters, pace and preemptions start
        again, and none counts in `aborts`. `progress` is told each wave as it starts. Exact
        mode has nothing to warm up."""
        say = progress or (lambda part: None)
        if not self.model.kernels.whole_chunk:
            say("nothing to warm up: exact mode compiles no kernels and captures no graphs")
            return
        vocab, room = self.model.spec.vocab_size, self.model.spec.max_context
        failed: list[BaseException] = []
        made, spaces = itertools.count(), set()
        aborts = collections.Counter(self.aborts)       # made-up requests count in no metric

        def asked(lengths: list[int], tokens: int) -> None:
            """Requests of prompts of `lengths` and `tokens` tokens each, waiting: prompts no
            other made-up request shares (none finds another's prefix cached)."""
            for n in lengths:
                salt = next(made)
                request = Request(WARM_UP, [(7 * j + 13 * salt + n) % vocab for j in range(n)], tokens, Sampling(),
                                  0, frozenset(), lambda kind, value: kind == "error" and failed.append(value),
                                  salt=WARM_UP)
                spaces.add(self._space(request))
                self.waiting.append(request)

        def served(lengths: list[int], tokens: int) -> None:
            """`asked`, then every request served to its end."""
            asked(lengths, tokens)
            while self.waiting or self.running or self.preempted:
                self._take_waiting()
                self._turn()

        try:
            top = 1 << (max(1, min(self.chunk_size, room - 8)).bit_length() - 1)    # a chunk's longest power of two
            lengths = [1 << k for k in range(top.bit_length())]
            say(f"prompts of {', '.join(map(str, lengths + [3, 9]))} tokens, alone and two at a time")
            for n in lengths + [3, 9]:         # (and rows of no power of two, fewer than a conv's taps and more)
                served([n], 1)                  # one session's chunk
                served([n, n], 1)               # two sessions' chunks in one pass (other ops see 2n rows)
            rows = 4 * top
            while rows < 2 * self.prefill_tokens and rows // top <= self.max_sessions:
                say(f"{rows // top} prompts of {top} tokens at a time")     # a turn's tokens, up to a power of two
                served([top] * (rows // top), 1)
                rows *= 2
            for width in sorted({lanes_for(n) for n in range(1, self.max_sessions + 1)}):
                n = min(width, self.max_sessions)
                say(f"{n} request{'s' if n > 1 else ''} decoding together")
                self.widest = 0
                # enough tokens that the first to decode still do when the last prompt is fed,
                # however few prompt tokens a turn feeds beside them
                served([2] * n, 4 + -(-2 * n // MIN_CHUNK))
                if self.widest < n:
                    say(f"(the widest step carried {self.widest})")
            say("a prompt arriving while a request decodes")
            asked([9], 8)
            for _ in range(3):                  # its prompt, its first steps
                self._take_waiting()
                self._turn()
            served([9], 1)
        finally:
            self._abandon()                     # (a made-up request's pass, if one raised mid-way)
            self.aborts = aborts
            for space in spaces:
                self.cache.forget(space)
            self.cache.lookups = self.cache.hits = self.cache.saved = self.cache.lost = 0
            self.pace, self.widest, self.preempted.count = Pace(), 0, 0
            self.timed.clear()
            self.prefills.clear()
            self.spent.clear()
        if failed:
            say(f"{len(failed)} made-up requests failed; the first: {type(failed[0]).__name__}: {failed[0]}")

    def submit(self, *requests: Request) -> None:
        """Queue `requests` (one HTTP request's prompts) together, or none of them: Overloaded
        when the waiting line has no room for them all."""
        with self._wake:
            over = _places(self.waiting) + _places(requests) > self.max_waiting
            if over and (self.waiting or self.max_waiting == 0):     # alone, any n may wait
                raise Overloaded(f"{len(self.waiting)} requests are waiting")
            self.waiting.extend(requests)
            self._arrived = time.perf_counter()
            self._wake.notify()

    def stop(self, drain_seconds: float = 30.0) -> None:
        """Let running and waiting requests finish (up to `drain_seconds`), then end the loop."""
        deadline = time.monotonic() + drain_seconds
        while (self.running or self.waiting or self.preempted) and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.01)
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self.thread.is_alive():
            self.thread.join(5)

    def clock_reset(self) -> None:
        """Start `spent` again from now (an idle wait in progress counts from now on). Call it
        while the loop is idle: a turn under way would add what it spent before the call."""
        with self._wake:
            self.spent.clear()
            self._idle_since = max(self._idle_since, time.perf_counter())

    @property
    def settled(self) -> bool:
        """Whether the loop has nothing left to do: no request, and its spare sessions made (or
        refused for now)."""
        return (not self.running and not self.waiting and not self.preempted
                and (len(self.spares) >= self.spare_sessions or self._spares_refused))

    @property
    def preemptions(self) -> int:
        """Requests preempted so far (/metrics, the bench)."""
        return self.preempted.count

    @property
    def depth(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting) + len(self.preempted)

    def counts(self) -> dict:
        """What /metrics shows of the engine, a moment's values read from any thread: requests
        running and waiting (preempted ones wait), preemptions so far, the prefix cache's counts,
        and aborted transactions by (kind, stage)."""
        running, waiting = self.depth
        cache = self.cache
        return {"running": running, "waiting": waiting, "preemptions": self.preemptions,
                "cache": {"lookups": cache.lookups, "hits": cache.hits, "saved": cache.saved, "used": cache.used,
                          "entries": len(cache.entries), "lost": cache.lost},
                "aborts": dict(self.aborts)}

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._turns()
        finally:
            self._abandon()                             # a paced pass's sessions are its own until it ends
            self._turned()

    def _turned(self) -> None:
        if self.after_turn is not None:
            self.after_turn()

    def _turns(self) -> None:
        while True:
            with self._wake:
                self._idle_since = time.perf_counter()
                while not self._stop and not self.waiting and not self.running and not self.preempted:
                    if len(self.spares) < self.spare_sessions and not self._spares_refused:
                        self._wake.release()            # a request may arrive meanwhile
                        try:
                            self.spares.append(self.model.session(decode="eager"))
                        except Exception:               # no memory for one now: admitting makes its own
                            self._spares_refused = True
                        finally:
                            self._wake.acquire()
                        continue
                    self._wake.wait()
                if self.gather and not self.running and not self.preempted:
                    self._gathered()
                self.spent["idle"] += time.perf_counter() - self._idle_since
                if self._stop:
                    self.spares.clear()             # their memory goes back with the loop
                    break
                if not self.preempted:              # they come back first (`_resume`)
                    self._take_waiting()
            try:
                self._turn()
            except Exception as exc:                    # a bug here must not strand the requests
                self._abandon()
                for request in self.running + list(self.preempted):
                    request.session = None          # its slot and blocks back, as `_end` does
                    request.emit("error", exc)
                self.running = []
                self.preempted.clear()
            self._turned()

    def _gathered(self) -> None:
        """(The loop's lock held, nothing running.) Wait while requests keep arriving less than
        `gather` seconds apart, up to GATHER_TIMES that since this began, or until enough wait
        to fill every place."""
        until = time.perf_counter() + GATHER_TIMES * self.gather
        while not self._stop and _places(self.waiting) < self.max_sessions:
            now = time.perf_counter()
            left = min(self._arrived + self.gather, until) - now
            if left <= 0:
                return
            self._wake.wait(left)

    def _take_waiting(self) -> None:
        """Waiting requests into the free places, first come first served, except that a key
        holding its share of the places lets a later request of another key go first."""
        while self.waiting and _places(self.running) < self.max_sessions:
            keys = {r.key for r in self.running} | {r.key for r in self.waiting}
            share = max(1, self.max_sessions // len(keys))
            held = collections.Counter(r.key for r in self.running)
            chosen = next((r for r in self.waiting if held[r.key] < share), self.waiting[0])
            if self.running and _places(self.running) + _places([chosen]) > self.max_sessions:
                return                              # its choices wait for room (alone, it runs at any n)
            self.waiting.remove(chosen)
            self.running.append(chosen)

    def _turn(self) -> None:
        clock = time.perf_counter()
        for request in [r for r in self.preempted if r.cancelled.is_set()]:
            self._drop(request)
        self._resume()
        for request in list(self.running):
            if request.cancelled.is_set() and not self._flying(request):     # (dropped once its pass ends)
                self._drop(request)
            elif request.session is None:
                try:
                    self._admit(request)
                except Exception as exc:            # its session could not be made: it alone fails
                    self._fail(request, exc)
        clock = self._spend("admit", clock)
        feeding = self._chunks()
        decoding = [r for r in self.running if r.fed >= len(r.prompt)]
        if self.passes == "paced":
            self._fly(feeding, bool(decoding))
        elif feeding and decoding and self.passes == "one":
            stepping = self._tokens(decoding)
            self._pass(feeding, stepping, self._spend("sample", clock))
            return
        elif feeding:
            self._pass(feeding, [], clock)
        decoding = [r for r in self.running if r.fed >= len(r.prompt)]
        if decoding:
            self._decode_step(decoding)

    def _chunks(self) -> list[tuple[Request, list[int]]]:
        """This turn's prompt chunks, oldest request first, within `_prompt_budget`: each
        request's chunk of `chunk_size` tokens at most; then, while no request decodes (no step
        waits for the pass), what the budget has left goes to the same requests, oldest first,
        each up to `_longest` (a pass costs the host about as much at any size, so a prompt alone
        goes in as few as it can, while every other prompt still gets its chunk each turn)."""
        if self.flight is not None:                     # (paced: one pass at a time)
            return []
        budget, sizes = self._prompt_budget(), {}
        shared = budget < self.prefill_tokens           # the share's budget cuts chunks; `prefill_tokens` does not
        prefilling = [r for r in self.running if r.fed < len(r.prompt)]
        for request in prefilling:
            if budget <= 0:
                break
            size = min(self.chunk_size, budget) if shared else self.chunk_size
            sizes[request.id] = min(size, len(request.prompt) - request.fed)
            budget -= sizes[request.id]
        if not any(r.fed >= len(r.prompt) for r in self.running):
            for request in prefilling:
                if budget <= 0 or request.id not in sizes:
                    break
                size = sizes[request.id]
                more = max(0, min(budget, self._longest(request) - size, len(request.prompt) - request.fed - size))
                sizes[request.id] += more
                budget -= more
        return [(r, r.prompt[r.fed:r.fed + sizes[r.id]]) for r in prefilling if r.id in sizes]

    def _longest(self, request: Request) -> int:
        """The longest chunk `request` takes while no request decodes: any, or, where its chunk
        keeps states for the prefix cache (one every `prefix_every` tokens, each a whole banked
        state on the device until the cache takes it), as many as the cache holds, at least
        `chunk_size`."""
        if not (request.keep and self.cache.keeps):
            return len(request.prompt)
        pool = getattr(self.model, "pool", None)        # (a model over ranks: each rank's own)
        slot = self.cache.slot_bytes or (pool.slot_nbytes if pool is not None else 0)
        held = self.cache.budget // slot if slot else 1
        return max(self.chunk_size, held * self.cache.every)

    def _prompt_budget(self) -> int:
        """Prompt tokens this turn may feed: `prefill_tokens`, and, with `prefill_share` and
        requests decoding, no more than keep the turn within 1 + that many decode steps' time
        (both measured: `self.pace`), but at least MIN_CHUNK and at least the prefilling requests' part of
        `prefill_tokens` by head count (a few decoders do not starve many waiting prompts)."""
        decoding = sum(r.fed >= len(r.prompt) for r in self.running)
        step_s, token_s = self.pace.step_s, self.pace.token_s
        if (self.passes == "paced" or self.prefill_share is None or not token_s or step_s is None
                or not decoding):                       # (a token measured at 0 s says nothing)
            return self.prefill_tokens
        # a turn of the step and its chunks within (1 + share) steps: with one pass a turn of eager
        # steps a step beside chunks costs more than one alone, the step the decoders see without
        # a prompt (`pace.alone`, where one of about this width was seen; a step alone that
        # replays graphs is another route, not a measure of it); with two the steps are alone
        comparable = self.passes == "one" and self.decode == "eager"
        alone = (self.pace.alone(decoding) if comparable else None) or step_s
        afford = int(((1 + self.prefill_share) * alone - step_s) / token_s)
        fair = self.prefill_tokens * (len(self.running) - decoding) // len(self.running)
        return max(MIN_CHUNK, min(self.prefill_tokens, max(afford, fair)))

    def _spend(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.spent[part] += now - since
        return now

    def _admit(self, request: Request) -> None:
        request.admitted_at = time.monotonic()
        self._spares_refused = False
        request.generator = torch.Generator().manual_seed(request.seed)
        if request.sampling.repetition_penalty != 1.0:
            request.seen = torch.zeros(self.model.spec.vocab_size, dtype=torch.bool, device=self.model.device)
            request.seen[upload(request.prompt, torch.int64, self.model.device)] = True
        for r in (request, *request.copies):
            if r.sampling.counts_output:
                r.counts = torch.zeros(self.model.spec.vocab_size, dtype=torch.float64, device=self.model.device)
        hit = self.cache.find(self._space(request), request.prompt) if request.keep and self.cache.keeps else None
        if hit is not None and hit.session is not None:
            request.session = self._made(hit.session.fork)
            request.cached = request.fed = hit.length
            request.logits = request.session.logits
        else:
            request.session = self.spares.pop() if self.spares else self._made(lambda: self.model.session(decode="eager"))
        request.cut = hit.cut if hit is not None else 0

    def _made(self, make):
        """`make()`, a session from the pool; while the pool is full, room is made (`_shed`)."""
        while True:
            try:
                return make()
            except AllocationError:
                if not self._shed():
                    raise

    def _shed(self) -> bool:
        """Give a slot back to the pool: a spare session's, else the prefix cache's least
        recently used entry's (its blocks too). False when there is neither."""
        if self.spares:
            self.spares.pop()               # a new session: its slot is back as it goes
            return True
        if not self.cache.shed():
            return False
        gc.collect()                        # an entry's session let go in a reference cycle
        return True

    def _slots_for(self, needed: int) -> None:
        """Let spare sessions go until the pool has `needed` free slots (or no spare is left)."""
        pool = getattr(self.model, "pool", None)        # (a model over ranks: each rank's own)
        while self.spares and pool is not None and pool.free_slots < needed:
            self.spares.pop()

    def _space(self, request: Request) -> tuple[str, str]:
        """The prefix cache's space a request sees: its key's, or every key's (shared), narrowed
        by its salt."""
        return ("" if self.share_prefixes else request.key, request.salt)

    def _pass(self, feeding: list[tuple[Request, list[int]]], stepping: list[tuple[Request, int]],
              clock: float) -> None:
        """Feed each request of `feeding` its next prompt chunk, keeping states for the prefix
        cache at its marks, and step each request of `stepping` by its token (chosen and sent
        already): in fast mode in one pass (`_feed_all`), else one after another. A request
        whose prompt is now fed, in a pass that stepped others, chooses and sends its first
        token at once; its step comes with the next turn's."""
        marked, kept = self._marked(feeding, stepping)
        self._counted(feeding)
        made = self._ahead(stepping)
        results = self._feed_all(feeding + [(r, [token]) for r, token in stepping], marked, kept)
        if made is not None:
            made.join()
        spent = time.perf_counter() - clock         # a feed returns once validated: synced
        self.pace.add(len(stepping), sum(len(c) for _, c in feeding), spent)
        self._fed(feeding, results, marked, kept, spent)
        if stepping:
            self.widest = max(self.widest, len(stepping) + len(feeding))
            for request, token in stepping:
                self._stepped(request, token, results[request.id])
            now = self._copied([r for r, _ in feeding if r in self.running and r.fed == len(r.prompt)
                                and r.pending is None])
            chosen = self._choose(now)
            for request in now:
                request.pending = chosen.get(request.id)
        self._spend("one pass" if stepping else "prefill", clock)

    def _fly(self, feeding: list[tuple[Request, list[int]]], decoding: bool) -> None:
        """`passes="paced"`: begin a pass of `feeding`'s chunks if none is under way, and
        advance the one under way: with requests `decoding`, by as many stages as
        `prefill_share` decode steps' time affords (`_stages`), else to its end. A pass that
        ends is taken in as `_pass` takes in its chunks."""
        clock = time.perf_counter()
        if self.flight is None and feeding:
            marked, kept = self._marked(feeding, [])
            self._counted(feeding)
            self.flight = Flight(feeding, marked, kept, Paced(lambda: self._feed_all(feeding, marked, kept)), clock)
        flight = self.flight
        if flight is None:
            return
        # the states it keeps take a slot each when it ends: spares made meanwhile go first
        self._slots_for(sum(map(len, flight.marked.values())))
        first, start = len(flight.paced.seconds), time.perf_counter()
        ended = flight.paced.advance(self._stages(first) if decoding else None)
        if self.model.device.type == "cuda":        # its stages' device work counts in their time
            torch.cuda.synchronize(self.model.device)
        ran = flight.paced.seconds[first:]
        host = sum(ran)
        scale = (time.perf_counter() - start) / host if host > 0 else 1.0     # (the device's wait shared among them)
        self.pace.staged(first, [s * scale for s in ran], len(self.model.stages) + 1)
        if ended:
            self.flight = None
            self._fed(flight.feeding, flight.paced.outcome(), flight.marked, flight.kept,
                      time.perf_counter() - flight.began)
            for request, _ in flight.feeding:       # cancelled while in the pass: it goes now
                if request.cancelled.is_set() and request in self.running:
                    self._drop(request)
        self._spend("prefill", clock)

    def _counted(self, feeding: list[tuple[Request, list[int]]]) -> None:
        """A pass of `feeding`'s prompt chunks (one at least) begins: counted in `timed` (bench)."""
        self.timed["prompt_passes"] += 1
        self.timed["prompt_tokens"] += sum(len(c) for _, c in feeding)

    def _flying(self, request: Request) -> bool:
        """Whether `request`'s chunk is in the paced pass under way (its session is the pass's
        until it ends: it is neither dropped nor preempted meanwhile)."""
        return self.flight is not None and any(r is request for r, _ in self.flight.feeding)

    def _abandon(self) -> None:
        """End the paced pass under way, if any, and let its outcome go (its requests are let go
        by the caller): its sessions are its own until it ends."""
        if self.flight is not None:
            self.flight.paced.advance(None)
            self.flight = None

    def _land(self) -> None:
        """Run the paced pass under way, if any, to its end and take it in."""
        while self.flight is not None:
            self._fly([], False)

    def _stages(self, first: int) -> int:
        """The stages a paced prompt pass runs this turn from its place `first`: as many as fit
        `prefill_share` decode steps alone, at what each stage took before (`Pace.stages_within`:
        at least one, so a stage that alone takes longer than the share overruns it)."""
        decoding = sum(r.fed >= len(r.prompt) for r in self.running)
        step_s = self.pace.alone(decoding) or self.pace.step_s
        if step_s is None:
            return 1
        return self.pace.stages_within(first, self.prefill_share * step_s, len(self.model.stages) + 1)

    def _marked(self, feeding: list[tuple[Request, list[int]]], stepping: list[tuple[Request, int]]):
        """Where each request's chunk keeps states for the prefix cache (`_marks`; none for a
        step) by request id, with a free slot of the pool for each state (spares are let go),
        and the dict the kept sessions will go in."""
        marked = {r.id: self._marks(r, len(c)) for r, c in feeding}
        marked.update((r.id, []) for r, _ in stepping)
        self._slots_for(sum(map(len, marked.values())))     # the states kept take a slot each
        return marked, {}

    def _feed_all(self, chunks: list[tuple[Request, list[int]]], marked: dict, kept: dict) -> dict:
        """Request id -> its logits or its failure after its chunk (`_each_or_together`): in
        fast mode in one pass (`feed_many`, or `feed_keeping_many` where a chunk keeps states:
        each its own transaction, so one that aborts fails alone)."""
        return self._each_or_together(
            chunks, lambda joint: self._prefill_together(joint, marked, kept),
            lambda r, c: self._feed_keeping(r, c, marked[r.id], kept) if marked[r.id] else self._feed(r, c))

    def _fed(self, feeding: list[tuple[Request, list[int]]], results: dict, marked: dict, kept: dict,
             spent: float) -> None:
        """Take in the outcomes of a pass's prompt chunks, `spent` seconds of it: the states kept
        go in the prefix cache, each request's prompt moves on (or it runs again, or fails)."""
        # cached only now, outside the feeds: a failure here must not read as a pass that
        # failed (its chunks would be fed again); the chunks are published, only states are lost
        for request, _ in feeding:
            if request.id in kept:
                try:
                    self._keep(request, marked[request.id], kept[request.id])
                except Exception:
                    self.cache.lost += 1            # /metrics counts it
        for request, chunk in feeding:
            result = results[request.id]
            if isinstance(result, BaseException):
                if not self._runs_again(request, result):
                    self._fail(request, result)
                continue
            request.logits = result
            request.prefill_s += spent
            request.fed += len(chunk)
            if request.fed == len(request.prompt):
                self.prefills.append(request.prefill_s)

    def _prefill_together(self, joint: list[tuple[Request, list[int]]], marked: dict, kept: dict) -> dict:
        """Two or more requests' chunks in one pass -> request id -> outcome (one is left
        alone); the sessions kept after a request's marks go in `kept` by its id."""
        if len(joint) < 2:
            return {}
        sessions, chunks = [r.session for r, _ in joint], [c for _, c in joint]
        if not any(marked[r.id] for r, _ in joint):
            return {r.id: result for (r, _), result in zip(joint, feed_many(sessions, chunks))}
        results = {}
        for (request, _), result in zip(joint, feed_keeping_many(sessions, chunks, [marked[r.id] for r, _ in joint])):
            if isinstance(result, BaseException):
                results[request.id] = result
            else:
                results[request.id], kept[request.id] = result
        return results

    def _decode_step(self, requests: list[Request]) -> None:
        """Sample each request's next token and send it at once (it is chosen: the step that
        commits it only makes the state catch up), then step them; a request whose step aborts
        ends with an error after the token it was committing."""
        clock = time.perf_counter()
        stepping = self._tokens(requests)
        clock = self._spend("sample", clock)
        together = self.spent["together"]
        made = self._ahead(stepping)
        results = self._each_or_together([(r, [token]) for r, token in stepping], self._step_together)
        if made is not None:
            made.join()
        now = time.perf_counter()
        self.spent["alone"] += now - clock - (self.spent["together"] - together)
        self.pace.add(len(stepping), 0, now - clock)
        for request, token in stepping:
            self._stepped(request, token, results[request.id])
        self._spend("finish", now)

    def _each_or_together(self, chunks: list[tuple[Request, list[int]]], together, alone=None) -> dict:
        """Request id -> its logits, or the exception that failed it, after feeding it its
        chunk: in fast mode those under no fault first in one call `together(their (request,
        chunk) pairs)` -> request id -> outcome (it may take none), then every request it did
        not take alone (`alone(request, chunk)`, `_feed` unless given); all of them alone when
        that call fails as a whole (no one session's abort)."""
        alone = alone or self._feed
        joint = [(r, c) for r, c in chunks if self.model.kernels.whole_chunk and not (self.fault and self.fault(r))]
        results = {}
        if joint:
            try:
                results = together(joint)
            except Exception:                       # not one session's abort: each alone
                results = {}
        for request, chunk in chunks:
            if request.id not in results:
                try:
                    results[request.id] = alone(request, chunk)
                except Exception as exc:            # an abort, or anything else: this request's alone
                    results[request.id] = exc
        return results

    def _tokens(self, requests: list[Request]) -> list[tuple[Request, int]]:
        """Each of `requests` (and their copies, made now) with the token it steps by next: the
        one it had chosen and sent already (`pending`), else one it samples now (`_choose`; one
        that fails to is left out)."""
        requests = self._copied(requests)
        chosen = self._choose([r for r in requests if r.pending is None])
        stepping = []
        for request in requests:
            if request.pending is not None:
                stepping.append((request, request.pending))
                request.pending = None
            elif request.id in chosen:
                stepping.append((request, chosen[request.id]))
        return stepping

    def _ahead(self, stepping: list[tuple[Request, int]]):
        """The constrained requests' values after their tokens, and their masks, made on a
        thread while the step runs (`state.constraint.ahead`); the thread, or None."""
        return ahead([(r.session.constraint, token) for r, token in stepping
                      if r.constrained and r.session is not None and r.session.constraint is not None])

    def _copied(self, requests: list[Request]) -> list[Request]:
        """`requests` and, for each whose prompt is fed and who has copies still to make, those
        copies: each a fork of its session (its prompt fed once for all), running from now on."""
        out = list(requests)
        for request in requests:
            if not request.copies or request.fed < len(request.prompt) or request.produced or request.pending is not None:
                continue
            copies, request.copies = request.copies, []
            for copy in copies:
                if copy.cancelled.is_set():
                    copy.emit("done", "cancelled")
                    continue
                try:
                    copy.session = self._made(request.session.fork)
                except Exception as exc:            # no slot for it: this choice alone fails
                    self._report(copy, exc)
                    continue
                copy.fed, copy.cached, copy.logits = request.fed, request.cached, request.logits
                copy.admitted_at, copy.prefill_s = request.admitted_at, request.prefill_s
                copy.generator = torch.Generator().manual_seed(copy.seed)
                copy.seen = request.seen.clone() if request.seen is not None else None
                self.running.append(copy)
                out.append(copy)
        return out

    def _choose(self, requests: list[Request]) -> dict[int, int]:
        """Request id -> the token it samples (`choice.tokens`), sent at once; a request with
        nothing left to sample from fails, alone. A request with a constraint samples from the
        tokens it allows, and one it allows nothing more finishes ("stop")."""
        for request in requests:
            if request.constraint is not None and not request.constrained:
                request.session.constrain(request.constraint)
                request.constrained = True
        limits = {r.id: r.session.constraint for r in requests if r.constrained}
        for request in [r for r in requests if r.id in limits and limits[r.id].finished]:
            self._finish(request, "stop")
        requests = [r for r in requests if r.id not in limits or not limits[r.id].finished]
        chosen = choice.tokens(requests, limits)
        scored = choice.logprobs([(r, t) for r, t in zip(requests, chosen) if r.logprobs is not None and type(t) is int])
        tokens = {}
        for request, token in zip(requests, chosen):
            if isinstance(token, BaseException):
                self._fail(request, token)
                continue
            tokens[request.id] = token
            if request.seen is not None:
                request.seen[token] = True
            if request.counts is not None:
                request.counts[token] += 1
            if request.id in scored:
                request.emit("logprobs", scored[request.id])
            request.emit("token", token)
        return tokens

    def _step_together(self, joint: list[tuple[Request, list[int]]]) -> dict:
        """One step of each request of `joint` by its one token, in one pass -> request id ->
        its logits or the `ChunkAborted` that aborted it. Anything else raised steps no request."""
        requests = [r for r, _ in joint]
        runner = self.model.steps(capture=True) if self.decode == "graph" else None
        replays, started = runner.replays if runner is not None else 0, time.perf_counter()
        try:
            step = self._together([r.session for r in requests], [chunk[0] for _, chunk in joint])
        finally:
            self.spent["together"] += time.perf_counter() - started
        kind = "replayed" if runner is not None and runner.replays > replays else "slow"
        self.timed[kind] += 1
        self.timed[kind + "_s"] += time.perf_counter() - started
        self.widest = max(self.widest, len(requests))
        return {r.id: result for r, result in zip(requests, step)}

    def _together(self, sessions: list, tokens: list[int]) -> list:
        """One step of `sessions` by `tokens` in one pass: from the static step plan (`Batch`)
        where the route takes it, else `feed_many` (on every rank of a model over ranks)."""
        if self.decode == "eager":
            return feed_many(sessions, tokens)
        return Batch(sessions, decode=self.decode).feed(tokens)

    def _stepped(self, request: Request, token: int, result) -> None:
        """Take in a request's step of `token`: its logits, or the exception that failed it."""
        if isinstance(result, BaseException):
            if self._runs_again(request, result):
                request.pending = token             # sent already: its step runs again
            else:
                self._fail(request, result)
            return
        request.logits = result
        request.produced.append(token)
        complete = (request.constrained and request.session is not None     # (preempted: found when it is back)
                    and request.session.constraint.finished)
        if token in request.stop_ids or complete:
            self._finish(request, "stop")
        elif len(request.produced) >= request.max_tokens:
            self._finish(request, "length")
        elif len(request.prompt) + len(request.produced) >= self.model.spec.max_context:
            self._finish(request, "length")

    def _marks(self, request: Request, length: int) -> list[int]:
        """Where a prompt chunk of `length` tokens keeps states for the prefix cache (counts of
        its tokens; none when the cache is off or the request keeps nothing)."""
        if not (request.keep and self.cache.keeps):
            return []
        start = request.fed
        stop = len(request.prompt)
        return [p - start for p in self.cache.marks(start, stop, request.cut) if p <= start + length]

    def _feed_keeping(self, request: Request, ids: list[int], marks: list[int], kept: dict) -> torch.Tensor:
        """Feed a prompt chunk; the sessions kept after its marks go in `kept` by its id."""
        logits, kept[request.id] = self._faulted(request, lambda: request.session.feed_keeping(ids, marks))
        return logits

    def _keep(self, request: Request, marks: list[int], kept: list) -> None:
        """Cache the sessions kept after `marks` of `request`'s chunk now fed."""
        space, start = self._space(request), request.fed
        for mark, session in zip(marks, kept):
            if session is not None:
                self.cache.put(space, request.prompt[:start + mark], session)

    def _feed(self, request: Request, ids: list[int]) -> torch.Tensor:
        return self._faulted(request, lambda: request.session.feed(ids))

    def _faulted(self, request: Request, feed):
        """`feed()`, under the fault the tests armed for this request, if any."""
        stage = self.fault(request) if self.fault else None
        if stage is None:
            return feed()
        with faults.inject(stage=stage, kind="nonfinite"):
            return feed()

    def _finish(self, request: Request, reason: str) -> None:
        if request.keep and self.cache.keeps and request.session is not None:
            # nothing steps its session again: it is kept itself (free of its constraint)
            if request.constrained:
                request.session.constrain(None)
            self.cache.put(self._space(request), request.prompt + request.produced, request.session)
        self._end(request)
        request.emit("done", reason)

    def _end(self, request: Request) -> None:
        """Take `request` out of the loop and let its session go: its slot and blocks return to
        the pool now (unless the prefix cache keeps it), not when the request is collected."""
        request.session = None
        if request in self.running:
            self.running.remove(request)
        else:                                       # ended while preempted
            self.preempted.remove(request)

    # ---- preemption -------------------------------------------------------------------------
    def _runs_again(self, request: Request, failure: BaseException) -> bool:
        """Whether a chunk that failed with `failure` runs again next turn rather than failing
        its request: the pool had no block for it, and it has been preempted already (to make
        room for another this turn) or room is made now."""
        return isinstance(failure, PoolExhausted) and (request in self.preempted or self._make_room(request))

    def _make_room(self, failed: Request) -> bool:
        """After `failed`'s chunk found the pool without a free block, free some so that it runs
        again next turn: the prefix cache's least recently used entries first, else the newest
        running request is preempted (`failed` itself, perhaps; a paced pass under way is run
        to its end first, so that its requests may be). False when nothing can be freed:
        `failed` holds the pool alone."""
        pool = self.model.pool
        before = pool.free_blocks
        while pool.free_blocks == before and self.cache.shed():
            pass
        if pool.free_blocks == before:
            gc.collect()                            # sessions let go in reference cycles give theirs back now
        if pool.free_blocks > before:
            return True
        if self.flight is not None:                 # its requests can be preempted once it ends
            self._land()
        holding = [r for r in self.running if r.session is not None]
        if not holding or holding == [failed]:
            return False
        newest = max(holding, key=lambda r: r.id)
        self.preempted.take(newest)                 # first: a failed host copy leaves it running
        self.running.remove(newest)
        return True

    def _resume(self) -> None:
        """Bring preempted requests back while there are places and blocks for them
        (`Preempted.back`); one that fails to come back fails alone."""
        for request, failure in self.preempted.back(self.model.pool, len(self.running), self.max_sessions,
                                                    self._shed, self._restored):
            if failure is None:
                self.running.append(request)
            else:
                self._report(request, failure)

    def _restored(self, request: Request):
        """A preempted request's session again: from its state in host memory, else fed its
        tokens again (holding blocks for them and a step more, no more: the pool is short), its
        constraint as it stood after them."""
        if request.host is not None:
            return self.model.from_host(request.host, decode="eager")
        tokens = request.prompt[:request.fed] + request.produced
        session = self.model.session(decode="eager", reserve=min(len(tokens) + 1, self.model.spec.max_context))
        if tokens:
            session.prefill(tokens, self.chunk_size)
        if request.constrained:
            session.constrain(request.constraint.after(request.produced))
        return session

    def _report(self, request: Request, exc: BaseException) -> None:
        """Send the exception that failed `request` (counted in `aborts` if an abort)."""
        if isinstance(exc, ChunkAborted):
            self.aborts[exc.kind, exc.stage] += 1
        request.emit("error", exc)

    def _fail(self, request: Request, exc: BaseException) -> None:
        self._end(request)
        self._report(request, exc)
        for copy in request.copies:             # its prompt never came to be forked: they fail with it
            self._report(copy, exc)
        request.copies = []

    def _drop(self, request: Request) -> None:
        self._end(request)
        request.emit("done", "cancelled")
        for copy in request.copies:
            copy.emit("done", "cancelled")
        request.copies = []


def _every(model) -> int:
    """The prefix cache's default k for `model`: a state kept every `model.prefill_chunk` // 8
    tokens of a prompt, 64 where a pass costs what its tokens do (a chunk of 512) and 1024 in
    fast mode on a GPU, where a pass of any length costs the host about the same (8192). There a
    hit's recompute of a thousand tokens costs about what one of 64 does, while each state kept
    splits every stateful stage's call of the chunk in two: keeping every 64 tokens of a
    2,064-token prompt took its prompt passes from 0.11 s to 1.02 s on an H100 (results/cuda-h100/d52a787)."""
    return model.prefill_chunk // 8


def _places(requests) -> int:
    """The places `requests` take: one each, and one for each of their copies still to be made."""
    return sum(1 + len(r.copies) for r in requests)
