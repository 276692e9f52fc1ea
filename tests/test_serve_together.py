"""How the server's decoding requests step together: each turn, one `Batch` of the sessions of
the requests decoding that turn. A request joins as soon as its prompt is fed and leaves when
it ends; nothing else is stepped. The engine loop's turns run here by hand on the CPU (fast
mode from the static step plan, uncaptured: the work a CUDA graph captures), against each
request run alone."""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import tokens
from hebrus.sampling import Sampling
from hebrus.scheduling.scheduler import Request, Scheduler

# (prompt length, new tokens, turn it arrives at): prompts of 8 a turn are fed while others decode
ARRIVALS = [(3, 4, 0), (12, 9, 1), (20, 3, 1), (5, 6, 4), (9, 2, 6)]
# requests decoding each turn (of ARRIVALS, by index): 0; 0; 0 1; 0 1 (0 ends); 1 2 3; 1 2 3;
# 1 2 3 (2 ends); 1 3 4; 1 3 4 (4 ends); 1 3 (3 ends); 1 (ends)
WIDTHS = [1, 1, 2, 2, 3, 3, 3, 3, 3, 2, 1]


def _asking(i: int, prompt: int, new: int, got: dict, key: str = "") -> Request:
    got[i] = []

    def emit(kind, value):
        if kind == "token":
            got[i].append(value)
    return Request(key=key, prompt=tokens(prompt, seed=prompt), max_tokens=new, sampling=Sampling(temperature=0.8),
                   seed=i, stop_ids=frozenset(), emit=emit, keep=bool(key))


def _turns(scheduler: Scheduler, got: dict, key: str = "", each_turn=None) -> list[Request]:
    """Run the loop's turns by hand, the requests of ARRIVALS arriving at their turns, until all
    have ended; `each_turn(requests)` is called after every turn."""
    requests = []
    for turn in range(100):
        arriving = [_asking(i, p, n, got, key) for i, (p, n, at) in enumerate(ARRIVALS) if at == turn]
        requests += arriving
        scheduler.running += arriving
        if not scheduler.running and len(requests) == len(ARRIVALS):
            return requests
        scheduler._turn()
        if each_turn is not None:
            each_turn(requests)
    raise AssertionError("the requests did not end")


@pytest.mark.parametrize("passes, share", [("one", None), ("two", None), ("paced", 0.5)])
def test_requests_joining_and_leaving_mid_run_each_get_what_they_get_alone(tiny, passes, share):
    """Exact mode: every request's tokens are bit for bit what its session generates alone,
    whoever decodes beside it, turn after turn, its steps in the pass of the turn's prompt
    chunks, in one of their own, or beside a prompt pass a few stages a turn."""
    got = {}
    scheduler = Scheduler(tiny, chunk_size=8, prefill_tokens=8, passes=passes, prefill_share=share)
    requests = _turns(scheduler, got)
    for i, request in enumerate(requests):
        alone = tiny.session().generate(request.prompt, max_new_tokens=request.max_tokens, temperature=0.8, seed=i)
        assert got[i] == list(alone), i


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tolerance: float = 2e-5) -> None:
    scale = max(float(b.abs().max()), 1.0)
    assert float((a - b).abs().max()) <= tolerance * scale, what


def test_one_pass_steps_exactly_the_requests_decoding_and_none_that_ended(tiny_fast):
    """Fast mode from the plan: each turn with a request decoding runs one planned step, as
    wide as the requests decoding that turn; a request that ended is never stepped again (its
    state stays as it left it), and its kept conversation is its own session. Each request's
    state is what an eager session fed the same tokens holds."""
    model = tiny_fast
    runner = model.steps(capture=False)
    scheduler = Scheduler(model, chunk_size=8, prefill_tokens=8, decode="planned")
    got, counts, left = {}, [], {}

    def each_turn(requests):
        counts.append((runner.uncaptured, sum(map(len, got.values()))))   # planned steps, tokens sent
        for r in requests:
            if r.produced and r not in scheduler.running:    # ended: its session is the cache's
                kept = scheduler.cache.find(("key", ""), r.prompt + r.produced).session
                left.setdefault(r.id, (kept.frontier, kept.digest()))
    steps, sent = runner.uncaptured, 0
    requests = _turns(scheduler, got, key="key", each_turn=each_turn)
    widths = []
    for now_steps, now_sent in counts:
        assert now_steps - steps == (now_sent > sent)       # one pass a turn, for all its decoders
        widths.append(now_sent - sent)
        steps, sent = now_steps, now_sent
    assert scheduler.widest == max(widths) and widths == WIDTHS
    for i, request in enumerate(requests):
        assert request.session is None                      # let go by the loop, kept by the cache
        session = scheduler.cache.find(("key", ""), request.prompt + request.produced).session
        assert (session.frontier, session.digest()) == left[request.id], i
        assert session.frontier == len(request.prompt) + len(got[i]) and got[i] == request.produced
        alone = model.session(decode="eager").feed(request.prompt + request.produced)
        _close(session.logits, alone, f"request {i}")


def test_one_pass_a_turn_carries_the_steps_and_the_prompt_chunks(tiny_fast, monkeypatch):
    """Fast mode, eager steps (`passes` "auto" is "one"): a turn with requests decoding runs one
    pass, in which they step (one token each) beside the chunks of prompts still being fed; a
    request whose prompt is fed sends its first token in that turn. Each request's tokens are
    the ones it sent, and its state is what an eager session fed them holds."""
    from hebrus.scheduling import scheduler as module
    model, passes = tiny_fast, []

    def counted(real):
        def pass_(sessions, chunks, *rest):
            passes[-1].append(sorted(len(c) for c in chunks))
            return real(sessions, chunks, *rest)
        return pass_
    monkeypatch.setattr(module, "feed_many", counted(module.feed_many))
    monkeypatch.setattr(module, "feed_keeping_many", counted(module.feed_keeping_many))
    scheduler = Scheduler(model, chunk_size=8, prefill_tokens=8)
    assert scheduler.passes == "one"
    got, unsent = {}, []

    def each_turn(requests):
        passes.append([])
        # a request whose prompt is fed has sent its first token in that same turn
        unsent.extend(r.id for r in requests if r.fed == len(r.prompt) and not got[requests.index(r)])
    passes.append([])
    requests = _turns(scheduler, got, key="key", each_turn=each_turn)
    passes.pop()
    assert all(len(turn) <= 1 for turn in passes)                   # never a second pass of chunks
    mixed = [turn[0] for turn in passes if turn and turn[0][0] == 1 and turn[0][-1] > 1]
    assert mixed, passes                                            # steps beside prompt chunks
    assert not unsent
    for i, request in enumerate(requests):
        assert got[i] == request.produced and len(got[i]) == request.max_tokens, i
        session = scheduler.cache.find(("key", ""), request.prompt + request.produced).session
        assert session.frontier == len(request.prompt) + len(got[i])
        alone = model.session(decode="eager").feed(request.prompt + request.produced)
        _close(session.logits, alone, f"request {i}")


def test_the_server_with_requests_ending_at_different_times_answers_as_sessions_alone(tiny_fast):
    """Requests of different lengths arriving together, so they end at different turns; each
    greedy answer is what its session gives alone, and a later turn from a kept conversation
    too."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import KEYS, Server, _greedy
    server = Server(tiny_fast, max_sessions=8)
    try:
        client = server.client()

        def ask(i):
            return client.completions.create(model="tiny", prompt=f"Speak {i}, speak", max_tokens=3 + 4 * i,
                                             temperature=0).choices[0].text
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        for i, text in enumerate(answers):
            assert text == _greedy(tiny_fast, f"Speak {i}, speak".encode(), 3 + 4 * i, temperature=0.0), i
        assert server.scheduler.widest > 1
        opening = list(b"Speak 2, speak")             # token ids: a random model's bytes are not always text
        follow = opening + list(tiny_fast.session().generate(opening, max_new_tokens=11)) + list(b" more")
        again = server.client(KEYS[0]).completions.create(model="tiny", prompt=follow, max_tokens=6, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == len(opening) + 11
        assert again.choices[0].text == _greedy(tiny_fast, bytes(follow), 6, temperature=0.0)
    finally:
        server.close()


def test_a_route_the_model_cannot_take_is_refused(tiny):
    from hebrus.errors import InvalidInput
    with pytest.raises(InvalidInput, match="planned"):
        Scheduler(tiny, decode="planned")


def test_a_turns_prompt_chunks_are_fed_in_one_pass_and_one_that_aborts_fails_alone(tiny_fast, monkeypatch):
    """Fast mode feeds the prompt chunks of a turn together (one `feed_many` of every request
    still prefilling, up to the budget); a request whose chunk aborts (the test-only fault hook:
    it is fed alone, under its fault) fails alone, and every other request's state is what a
    session fed its prompt alone holds."""
    import hebrus.scheduling.scheduler as scheduling
    passes = []
    real = scheduling.feed_many
    monkeypatch.setattr(scheduling, "feed_many", lambda sessions, chunks: passes.append(len(sessions)) or
                        real(sessions, chunks))
    doomed = tokens(13, seed=99)
    scheduler = Scheduler(tiny_fast, chunk_size=8, prefill_tokens=64, decode="planned",
                          fault=lambda r: "head" if r.prompt == doomed else None)
    got, ends = {}, {}
    requests = [_asking(i, n, 4 if i == 0 else 1, got) for i, n in enumerate([5, 12, 20])]
    requests.append(Request(key="", prompt=doomed, max_tokens=1, sampling=Sampling(), seed=0,
                            stop_ids=frozenset(), emit=lambda kind, value: ends.setdefault(kind, value)))
    scheduler.running += requests[:1]
    scheduler._turn()                       # request 0's prompt, alone and whole (no request decodes)
    scheduler.running += requests[1:]
    scheduler._turn()                       # the three others' first chunks, of 8 (request 0 decodes): two in one pass
    assert passes == [2] and "error" in ends and requests[3] not in scheduler.running
    scheduler._turn()                       # the two longer ones' second chunks
    scheduler._turn()                       # the longest one's third chunk (alone: no pass together)
    assert passes == [2, 2]
    for request in requests[:3]:            # each fed its prompt, then its tokens
        assert request not in scheduler.running and len(request.produced) == request.max_tokens
        alone = tiny_fast.session(decode="eager").feed(request.prompt + request.produced)
        _close(request.logits, alone, f"request {request.id}")


def test_while_none_decodes_a_long_prompt_takes_what_the_budget_leaves_after_every_prompts_chunk(tiny_fast):
    """A turn with no request decoding: every prompt gets its chunk first, oldest first, and the
    budget's rest goes to the oldest, so a long prompt ahead of short ones does not hold them
    back; with the prefix cache keeping its states, a chunk grows only to as many as it holds."""
    got = {}
    long_one = _asking(0, 1000, 1, got)
    shorts = [_asking(i, 10, 4, got) for i in range(1, 6)]
    scheduler = Scheduler(tiny_fast, chunk_size=32, prefill_tokens=128, decode="eager", cache_bytes=0)
    scheduler.running += [long_one, *shorts]
    scheduler._turn()
    assert [r.fed for r in shorts] == [10] * 5 and long_one.fed == 128 - 50
    scheduler._turn()                           # the shorts decode now: chunks of 32 again
    assert long_one.fed == 128 - 50 + 32
    keeping = _asking(7, 1000, 1, got, key="k")     # its chunk keeps states: at most what the cache holds
    slot = tiny_fast.session().image.pool.slot_nbytes
    scheduler = Scheduler(tiny_fast, chunk_size=32, prefill_tokens=512, decode="eager", prefix_every=16,
                          cache_bytes=5 * slot)
    scheduler.running.append(keeping)
    scheduler._turn()
    assert keeping.fed == 5 * 16


@pytest.mark.parametrize("cache_bytes", [0, 1 << 24])
def test_warming_up_leaves_nothing_behind_and_changes_no_answer(tiny, tiny_fast, cache_bytes, monkeypatch):
    """`warm_up` serves made-up requests through the loop's own turns at every lane width up to
    max_sessions (what a GPU compiles and captures before serving): afterwards the pool holds
    what it held, the prefix cache and the loop's counters are empty, and requests get exactly
    the tokens a scheduler that never warmed up gives them. Exact mode has nothing to warm up."""
    told = []
    Scheduler(tiny, max_sessions=4).warm_up(told.append)
    assert len(told) == 1 and "nothing to warm up" in told[0]
    tiny = tiny_fast
    import gc
    from hebrus.scheduling import scheduler as loop
    pool = tiny.pool
    gc.collect()
    free = (pool.free_slots, pool.free_blocks)
    passes = []
    for name in ("feed_many", "feed_keeping_many"):
        def recorded(sessions, chunks, *rest, _feed=getattr(loop, name)):
            passes.append(tuple(len(c) if hasattr(c, "__len__") else 1 for c in chunks))
            return _feed(sessions, chunks, *rest)
        monkeypatch.setattr(loop, name, recorded)
    warmed = Scheduler(tiny, max_sessions=4, chunk_size=8, prefill_tokens=8, cache_bytes=cache_bytes)
    told = []
    warmed.warm_up(told.append)
    assert any("4 requests decoding together" in part for part in told), told
    assert not any("failed" in part or "widest" in part for part in told), told
    for n in (1, 2, 4):             # two prompts in one pass (2n within a turn): none found the other's cached
        assert (n, n) in passes, (n, passes)
    assert warmed.preemptions == 0
    assert warmed.widest == 0 and not warmed.timed and not warmed.spent and not warmed.prefills
    assert not warmed.cache.entries and warmed.cache.used == 0 and warmed.cache.lookups == 0
    assert not warmed.running and not warmed.waiting and not warmed.preempted
    gc.collect()
    assert (pool.free_slots, pool.free_blocks) == free
    got_warmed, got_cold = {}, {}
    _turns(warmed, got_warmed, key="k")
    _turns(Scheduler(tiny, max_sessions=4, chunk_size=8, prefill_tokens=8, cache_bytes=cache_bytes), got_cold, key="k")
    assert got_warmed == got_cold


def _paced(model, first_tokens: int = 60):
    """A paced scheduler (no prefix cache), one request decoding (greedy) and two long prompts
    just made its pass: (scheduler, got, the decoder, the two)."""
    gc.collect()                            # sessions of earlier tests give their blocks back now
    scheduler = Scheduler(model, chunk_size=64, prefill_tokens=64, passes="paced", prefill_share=0.25, cache_bytes=0)
    got = {}
    decoder, *long = [_asking(0, 4, first_tokens, got), _asking(1, 60, 3, got), _asking(2, 50, 3, got)]
    for request in (decoder, *long):
        request.sampling = Sampling()
    scheduler.running.append(decoder)
    while decoder.fed < len(decoder.prompt):
        scheduler._turn()
    scheduler.running += long
    scheduler._turn()
    assert scheduler.flight is not None and [r for r, _ in scheduler.flight.feeding] == long
    return scheduler, got, decoder, long


def test_a_paced_prompt_pass_spans_turns_while_the_decoders_step_every_turn(tiny):
    """`passes="paced"`: a prompt pass advances a few stages a turn, and every turn steps the
    requests decoding, so a long prompt never holds them for a whole pass. One pass is under way
    at a time (a prompt arriving meanwhile waits for the next); a request cancelled while its
    chunk is in the pass ends when the pass does. Exact mode: every answer is bit for bit what
    its session gives alone."""
    scheduler, got, decoder, long = _paced(tiny)
    flight = scheduler.flight
    late = _asking(3, 30, 2, got)
    late.sampling = Sampling()
    scheduler.running.append(late)
    long[1].cancelled.set()
    turns = 0
    while scheduler.flight is flight:
        before = len(got[0])
        scheduler._turn()
        turns += 1
        assert len(got[0]) == before + 1 and late.fed == 0          # the decoder stepped; one pass at a time
    assert turns >= 2
    assert long[1] not in scheduler.running and long[1].session is None and not got[2]
    while scheduler.running:
        scheduler._turn()
    for request in (decoder, long[0], late):
        alone = tiny.session(decode="eager").generate(request.prompt, max_new_tokens=request.max_tokens)
        assert got[request.id - decoder.id] == list(alone), request.id


def test_making_room_while_a_paced_pass_is_under_way_ends_it_first_and_preempts_the_newest(tiny):
    """The pool short of blocks mid-pass: the pass runs to its end (its requests' sessions are
    its own until then), and the newest request is preempted, as with two passes; what each
    request produces is unchanged (exact mode: bit for bit)."""
    scheduler, got, decoder, long = _paced(tiny, first_tokens=12)
    assert scheduler._make_room(decoder)
    assert scheduler.flight is None and long[0].fed == 60 and long[1].fed == 50
    assert long[1] in scheduler.preempted and decoder in scheduler.running
    while scheduler.running or scheduler.preempted:
        scheduler._turn()
    for request in (decoder, *long):
        alone = tiny.session(decode="eager").generate(request.prompt, max_new_tokens=request.max_tokens)
        assert got[request.id - decoder.id] == list(alone), request.id


def test_the_server_with_paced_passes_answers_as_sessions_alone(tiny):
    """`hebrus serve --passes paced` through HTTP: the engine thread runs each prompt's pass a
    few stages a turn beside the requests decoding (its stages measured), and every greedy answer
    is bit for bit what its session gives alone (exact mode), however the passes fell."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import Server, _greedy
    server = Server(tiny, max_sessions=4, passes="paced", prefill_share=0.5, prefill_chunk=16)
    try:
        client = server.client()
        prompts = [f"Speak {i}, " + "and speak again " * (3 * i) for i in range(4)]

        def ask(i):
            return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12 - 2 * i,
                                             temperature=0).choices[0].text
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
        for i, text in enumerate(answers):
            assert text == _greedy(tiny, prompts[i].encode(), 12 - 2 * i, temperature=0.0), i
        assert server.scheduler.passes == "paced" and server.scheduler.pace.stage_s
    finally:
        server.close()
    assert server.scheduler.flight is None
