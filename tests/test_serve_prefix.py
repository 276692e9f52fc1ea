"""The engine loop's prefix cache: a prompt that begins with cached tokens forks the nearest
state kept at or below where it leaves them, feeds only the rest, and answers exactly as a cold
run (exact mode: bit for bit; fast mode: within its bound). The loop's turns run here by hand."""
from __future__ import annotations

import gc

import pytest

import hebrus
from conftest import tokens
from hebrus.errors import PoolExhausted
from hebrus.sampling import Sampling
from hebrus.scheduling.scheduler import Request, Scheduler

SHARED = tokens(1000, seed=7)


def _ask(prompt: list[int], new: int = 4, key: str = "k", salt: str = "", seed: int = 0) -> Request:
    """A request whose tokens land in `.got`."""
    got = []

    def emit(kind, value):
        if kind == "token":
            got.append(value)
        elif kind == "error":
            raise AssertionError(f"the request failed: {value!r}")
    request = Request(key=key, prompt=prompt, max_tokens=new, sampling=Sampling(temperature=0.8), seed=seed,
                      stop_ids=frozenset(), emit=emit, salt=salt)
    request.got = got
    return request


def _run(scheduler: Scheduler, *requests: Request) -> list[Request]:
    """Each request run to its end through the loop's turns, one after another."""
    for request in requests:
        scheduler.running.append(request)
        for _ in range(10_000):
            if request not in scheduler.running:
                break
            scheduler._turn()
        assert request.got and request not in scheduler.running
    return list(requests)


def _alone(model, request: Request) -> list[int]:
    return list(model.session().generate(request.prompt, max_new_tokens=request.max_tokens, temperature=0.8,
                                         seed=request.seed))


@pytest.mark.parametrize("cut", [300, 256, 280, 64, 5])
def test_a_cached_prefix_answers_bit_for_bit_as_a_cold_run(tiny, cut):
    """Cuts inside a block of k = 64 and a row block of 16 (300, 280), at the edge of both
    (256, 64), and before the first kept state (5)."""
    scheduler = Scheduler(tiny, chunk_size=128, prefill_tokens=512)
    first, second = _run(scheduler, _ask(SHARED[:300] + [1, 2, 3]), _ask(SHARED[:cut] + [9, 8, 7, 6], seed=1))
    assert first.cached == 0 and second.cached == (cut // 64) * 64
    for request in (first, second):
        assert request.got == _alone(tiny, request)
    third = _run(scheduler, _ask(SHARED[:cut] + [5, 4], seed=2))[0]
    assert third.cached == cut and third.got == _alone(tiny, third)   # the cut was kept: nothing recomputed


def test_k_defaults_to_an_eighth_of_the_models_prefill_chunk(tiny, tiny_fast, monkeypatch):
    """64 where a chunk of 512 is the model's (exact mode, or a CPU), 1024 where it is 8192 (fast
    mode on a GPU: a pass of any length costs the host about the same); a k given is kept."""
    assert Scheduler(tiny).cache.every == Scheduler(tiny_fast).cache.every == 64
    assert Scheduler(tiny, prefix_every=16).cache.every == 16
    monkeypatch.setattr(type(tiny_fast), "prefill_chunk", property(lambda self: 8192))
    assert Scheduler(tiny_fast, decode="eager").cache.every == 1024


def test_sharing_a_thousand_tokens_recomputes_fewer_than_k_on_the_first_hit_and_none_after(tiny):
    scheduler = Scheduler(tiny, chunk_size=256, prefill_tokens=512, prefix_every=64)
    cold, first, later = _run(scheduler, *(_ask(SHARED + tokens(10, seed=s), seed=s) for s in (1, 2, 3)))
    assert cold.cached == 0
    assert 0 < 1000 - first.cached < 64 and later.cached == 1000
    assert scheduler.cache.hits == 2 and scheduler.cache.saved == first.cached + 1000


def test_a_system_prompt_all_clients_hit_outlasts_their_own_ends_in_a_small_cache(tiny):
    """Workload (b) in a cache of six entries: a system prompt fed cold, clients that each hit
    it and each leave states no other prompt shares (their ends, their turns' ends), more than
    the cache holds; the next request still finds the state they found (the entries found go
    after those never found): with least recently used alone, it found nothing."""
    probe = tiny.session()
    pool = probe.image.pool
    system = SHARED[:200]
    blocks = len(system) // pool.block_rows + 9      # the system prompt's, shared by reference, and a few own
    scheduler = Scheduler(tiny, chunk_size=256, prefill_tokens=512, prefix_every=64,
                          cache_bytes=6 * pool.slot_nbytes + blocks * pool.block_nbytes)
    del probe
    cold = _run(scheduler, _ask(system + tokens(8, seed=50), seed=50))[0]
    clients = [_ask(system + tokens(8, seed=s), seed=s) for s in range(51, 59)]
    _together(scheduler, clients)               # all found the prefix, then each left its own
    after = _run(scheduler, _ask(system + tokens(8, seed=60), seed=60))[0]
    assert cold.cached == 0 and all(r.cached >= 192 for r in clients)
    # the state the clients found (fewer than k short of where they part) outlasted their ends
    assert len(system) - 64 < after.cached <= len(system) and after.got == _alone(tiny, after)
    assert len(scheduler.cache.entries) <= 6


def test_in_fast_mode_a_cached_prefix_is_within_the_bound_of_a_cold_run(tiny_fast):
    scheduler = Scheduler(tiny_fast, chunk_size=256, prefill_tokens=512, decode="eager")
    requests = _run(scheduler, *(_ask(SHARED[:n] + [3, n % 256], seed=n) for n in (1000, 700, 999, 700)))
    assert [r.cached for r in requests] == [0, 640, 960, 702]
    for request in requests:
        alone = tiny_fast.session().feed(request.prompt + request.got)
        scale = max(float(alone.abs().max()), 1.0)
        assert float((request.logits - alone).abs().max()) <= 1e-3 * scale


def test_in_fast_mode_chunks_that_keep_states_share_one_pass_and_later_prompts_hit_them(tiny_fast, monkeypatch):
    """Three prompts arriving together: their chunks, marks and all, go in one pass
    (`feed_keeping_many`; whole, as no request decodes yet); what they keep serves later
    requests, whose answers stay within fast mode's bound of cold runs."""
    import hebrus.scheduling.scheduler as scheduling
    passes, real = [], scheduling.feed_keeping_many
    monkeypatch.setattr(scheduling, "feed_keeping_many",
                        lambda sessions, chunks, marks: passes.append(len(sessions)) or real(sessions, chunks, marks))
    scheduler = Scheduler(tiny_fast, chunk_size=64, prefill_tokens=512, prefix_every=16, decode="eager")
    prompts = [SHARED[:100] + tokens(n, seed=n) for n in (20, 50, 90)]
    first = [_ask(p, seed=i) for i, p in enumerate(prompts)]
    _together(scheduler, first)
    assert passes[0] == 3 and all(r.cached == 0 for r in first)
    later = _run(scheduler, *(_ask(p[:-5] + [1, 2], seed=9) for p in prompts))
    assert [r.cached for r in later] == [len(p) - 5 - (len(p) - 5) % 16 for p in prompts]
    for request in first + later:
        alone = tiny_fast.session().feed(request.prompt + request.got)
        scale = max(float(alone.abs().max()), 1.0)
        assert float((request.logits - alone).abs().max()) <= 1e-3 * scale


def test_a_failure_caching_kept_states_never_feeds_a_chunk_again(tiny_fast, monkeypatch):
    """The cache refusing a kept state once (after the turn's pass has published its chunks):
    the states are lost (and counted), the chunks stay fed once, and the requests answer as
    cold runs do."""
    scheduler = Scheduler(tiny_fast, chunk_size=64, prefill_tokens=512, prefix_every=16, decode="eager")
    real, failed = scheduler.cache.put, []

    def put(*args):
        if not failed:
            failed.append(True)
            raise RuntimeError("a cache that fails once")
        return real(*args)
    monkeypatch.setattr(scheduler.cache, "put", put)
    requests = [_ask(SHARED[:40] + tokens(n, seed=n), seed=i) for i, n in enumerate((5, 9))]
    scheduler.waiting.extend(requests)
    scheduler._take_waiting()
    scheduler._turn()
    assert failed and all(r.session.frontier == r.fed + len(r.produced) for r in requests)
    assert scheduler.cache.lost == 1                            # counted for /metrics
    _together(scheduler, [])
    for request in requests:
        alone = tiny_fast.session().feed(request.prompt + request.got)
        scale = max(float(alone.abs().max()), 1.0)
        assert float((request.logits - alone).abs().max()) <= 1e-3 * scale


def test_a_key_or_a_salt_never_sees_anothers_prefixes(tiny):
    scheduler = Scheduler(tiny, chunk_size=256, prefill_tokens=512)
    prompt = SHARED[:150]
    owner = _run(scheduler, _ask(prompt, key="a"))[0]
    others = _run(scheduler, _ask(prompt, key="b"), _ask(prompt, key="a", salt="s"), _ask(prompt, key="a"))
    assert owner.cached == 0 and [r.cached for r in others] == [0, 0, 150]
    # a miss does the whole work of a cold run: every prompt token fed, none forked from the cache
    assert all(r.fed == len(prompt) for r in others) and scheduler.cache.hits == 1
    for request in (owner, *others):
        assert request.got == _alone(tiny, request)


def test_a_key_spreading_its_prompts_over_salts_keeps_to_one_keys_share(tiny):
    """The share bounds a key, not a salt: key "a" asking under eight salts evicts its own
    states, and key "b"'s prefix, kept first, is still found. A prompt of 100 tokens keeps
    three states (at 64, its end, its turn's end) over 7 blocks of 16 rows: the cache has room
    for six such prompts, a key's share for one and a half; a share per salt would let "a"'s
    eight fill it, the least recently used ("b"'s) going first."""
    probe = tiny.session()
    pool = probe.image.pool
    del probe
    scheduler = Scheduler(tiny, chunk_size=256, prefill_tokens=512, prefix_every=64,
                          cache_bytes=6 * (3 * pool.slot_nbytes + 7 * pool.block_nbytes))
    _run(scheduler, _ask(SHARED[:100], key="b"))
    _run(scheduler, *(_ask(tokens(100, seed=70 + i), key="a", salt=str(i), seed=i) for i in range(8)))
    assert scheduler.cache.used_by("a") <= scheduler.cache.per_holder
    again = _run(scheduler, _ask(SHARED[:100] + [5], key="b", seed=9))[0]
    assert again.cached == 100 and again.got == _alone(tiny, again)


def test_shared_prefixes_are_one_space_for_every_key(tiny):
    scheduler = Scheduler(tiny, chunk_size=256, prefill_tokens=512, share_prefixes=True)
    _, other, salted = _run(scheduler, _ask(SHARED[:300], key="a"), _ask(SHARED[:300], key="b"),
                            _ask(SHARED[:300], key="b", salt="s"))
    assert (other.cached, salted.cached) == (300, 0)


def test_a_full_pool_takes_back_the_caches_slots_for_new_requests(tiny):
    probe = hebrus.load("tiny").pool
    model = hebrus.load("tiny", pool_bytes=12 * probe.slot_nbytes + 256 * probe.block_nbytes)
    scheduler = Scheduler(model, chunk_size=256, prefill_tokens=512, prefix_every=8, spare_sessions=0)
    kept = 0
    for seed in range(4):                       # 20 states kept each (every 8th of 150, the end, the turn's end)
        request = _run(scheduler, _ask(tokens(150, seed=seed), seed=seed))[0]
        assert request.got == _alone(tiny, request)      # the same preset's weights
        kept += 20
        del request
        gc.collect()
    assert model.pool.slots < kept and 0 < len(scheduler.cache.entries) <= model.pool.slots


def test_spares_holding_every_free_slot_give_them_to_the_states_a_prompt_keeps(tiny):
    """The idle loop may fill a small pool with spare sessions; a prompt's states for the prefix
    cache still find slots (spares are let go for them), so a later request finds the prefix."""
    model = _pool_of(slots=12, blocks=64)
    scheduler = Scheduler(model, chunk_size=256, prefill_tokens=512, prefix_every=8)
    while model.pool.free_slots and len(scheduler.spares) < scheduler.spare_sessions:
        scheduler.spares.append(model.session(decode="eager"))       # as the idle loop makes them
    assert model.pool.free_slots == 0
    prompt = tokens(150, seed=5)
    first, second = _run(scheduler, _ask(prompt), _ask(prompt + [3, 4], seed=1))
    assert first.cached == 0 and second.cached > 0 and second.cached % 8 == 0    # (0 where spares kept every slot)
    assert second.got == _alone(tiny, second)


# ---- preemption and the per-key share ----------------------------------------------------------

def _pool_of(slots: int, blocks: int, mode: str = "exact"):
    """The tiny preset with a pool of `slots` slots and `blocks` blocks of 16 rows."""
    from hebrus.state.pool import Pool
    model = hebrus.load("tiny", mode=mode)
    model._pool = Pool(model.owners, model.device, slots, blocks, 16, model.spec.max_context)
    return model


def test_spare_sessions_are_as_many_as_the_places_and_let_go_of_their_slots_first():
    """By default the idle loop keeps a spare session for every place; where the pool has no
    slot for a session the loop needs, a spare gives its slot back before anything else, and
    with neither a spare nor a cached entry left the allocation error stands."""
    from hebrus.errors import AllocationError
    model = _pool_of(slots=3, blocks=12)
    scheduler = Scheduler(model, max_sessions=3)
    assert scheduler.spare_sessions == 3
    scheduler.spares = [model.session(decode="eager") for _ in range(3)]
    assert model.pool.free_slots == 0
    made = scheduler._made(lambda: model.session(decode="eager"))
    assert len(scheduler.spares) == 2 and made is not None and model.pool.free_slots == 0
    scheduler.spares.clear()
    held = [made] + [model.session(decode="eager") for _ in range(2)]
    with pytest.raises(AllocationError):
        scheduler._made(lambda: model.session(decode="eager"))
    assert len(held) == 3


def _together(scheduler: Scheduler, requests: list[Request]) -> None:
    """The requests arriving at once, run through the loop's turns until all have ended."""
    scheduler.waiting.extend(requests)
    for _ in range(10_000):
        if not (scheduler.waiting or scheduler.running or scheduler.preempted):
            return
        if not scheduler.preempted:
            scheduler._take_waiting()
        scheduler._turn()
    raise AssertionError("the requests did not end")


@pytest.mark.parametrize("host_bytes", [1 << 30, 0])
def test_preempted_requests_answer_bit_for_bit_as_they_do_alone(tiny, host_bytes):
    """Four requests of 30 prompt tokens and 40 new ones need 20 blocks of 16 rows; the pool
    has 12. Requests are preempted (their state to host memory, or recomputed from their tokens
    when host memory is 0) and come back; each answers exactly as it does alone."""
    model = _pool_of(slots=8, blocks=12)
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0,
                          preempt_host_bytes=host_bytes)
    requests = [_ask(tokens(30, seed=s), new=40, key=f"k{s}", seed=s) for s in range(4)]
    _together(scheduler, requests)
    assert scheduler.preemptions > 0 and scheduler.preempted.held == 0
    for request in requests:
        assert len(request.got) == 40 and request.got == _alone(tiny, request)   # the same preset's weights
    gc.collect()
    assert model.pool.free_blocks == 12 and model.pool.free_slots == 8


def _preempting(host_bytes: int = 1 << 30):
    """Four requests too many for the pool, run until one is preempted with its state in host
    memory -> (the model, the scheduler, the requests, each one's events)."""
    model = _pool_of(slots=8, blocks=12)
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0,
                          preempt_host_bytes=host_bytes)
    events = {s: [] for s in range(4)}
    requests = [Request(key=f"k{s}", prompt=tokens(30, seed=s), max_tokens=40, sampling=Sampling(temperature=0.8),
                        seed=s, stop_ids=frozenset(), emit=lambda kind, value, s=s: events[s].append((kind, value)))
                for s in range(4)]
    scheduler.waiting.extend(requests)
    for _ in range(10_000):
        if scheduler.preempted and scheduler.preempted.held > 0:
            return model, scheduler, requests, events
        if not scheduler.preempted:
            scheduler._take_waiting()
        scheduler._turn()
    raise AssertionError("nothing was preempted")


def test_a_request_cancelled_while_preempted_gives_its_host_copy_and_blocks_back():
    model, scheduler, requests, events = _preempting()
    gone = list(scheduler.preempted)
    for request in gone:
        request.cancelled.set()
    _together(scheduler, [])
    assert scheduler.preempted.held == 0 and not scheduler.preempted
    for request in gone:
        assert request.host is None and events[requests.index(request)][-1] == ("done", "cancelled")
    gc.collect()
    assert model.pool.free_blocks == 12 and model.pool.free_slots == 8


def test_a_loop_that_fails_answers_preempted_requests_and_gives_their_memory_back():
    model, scheduler, requests, events = _preempting()
    held = list(scheduler.preempted)

    def fails():
        scheduler._stop = True                  # the loop ends after answering them
        raise RuntimeError("a bug in a turn")
    scheduler._turn = fails
    scheduler._loop()
    assert scheduler.preempted.held == 0 and not scheduler.preempted and not scheduler.running
    for request in requests:
        assert events[requests.index(request)][-1][0] in ("error", "done")
    for request in held:
        assert request.host is None
    gc.collect()
    assert model.pool.free_blocks == 12 and model.pool.free_slots == 8


def test_a_host_copy_that_fails_leaves_no_request_unanswered(monkeypatch):
    """Making room preempts the newest request; where its host copy fails, the turn fails and
    the loop answers every request, the one it was preempting among them."""
    model = _pool_of(slots=8, blocks=12)
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0)
    events = {s: [] for s in range(4)}
    requests = [Request(key=f"k{s}", prompt=tokens(30, seed=s), max_tokens=40, sampling=Sampling(temperature=0.8),
                        seed=s, stop_ids=frozenset(), emit=lambda kind, value, s=s: events[s].append((kind, value)))
                for s in range(4)]

    def fails(session):
        raise RuntimeError("no host memory")
    monkeypatch.setattr(type(model.session()), "host_copy", fails)
    turn = scheduler._turn

    def turn_once_failed():
        try:
            turn()
        except Exception:
            scheduler._stop = True
            raise
    scheduler._turn = turn_once_failed
    scheduler.waiting.extend(requests)
    scheduler._take_waiting()
    scheduler._loop()
    assert all(events[s] and events[s][-1][0] in ("done", "error") for s in range(4)), events


def test_in_fast_mode_preempted_requests_stepped_together_stay_within_the_bound(tiny_fast):
    """The decoding requests step together from the static plan (what a CUDA graph captures);
    a request refused its block in the shared step is preempted or has room made, and comes
    back; each one's state is within fast mode's bound of its tokens fed alone."""
    model = _pool_of(slots=8, blocks=12, mode="fast")
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0,
                          decode="planned")
    requests = [_ask(tokens(30, seed=s), new=40, key=f"k{s}", seed=s) for s in range(4)]
    _together(scheduler, requests)
    assert scheduler.preemptions > 0 and scheduler.widest > 1
    for request in requests:
        assert len(request.got) == 40
        alone = tiny_fast.session(decode="eager").feed(request.prompt + request.got)
        scale = max(float(alone.abs().max()), 1.0)
        assert float((request.logits - alone).abs().max()) <= 1e-3 * scale


def test_a_request_that_holds_the_pool_alone_and_still_does_not_fit_fails_alone(tiny):
    model = _pool_of(slots=4, blocks=2)
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0)
    errors = []
    big = _ask(tokens(20, seed=1), new=30, seed=1)

    def emit(kind, value):
        if kind == "error":                     # (its traceback's frames would hold the session)
            errors.append(type(value))
        else:
            big.got.append(value)
    big.emit = emit
    small = _ask(tokens(5, seed=2), new=3, seed=2)
    _together(scheduler, [big, small])
    assert errors == [PoolExhausted]
    assert small.got == _alone(tiny, small)


def test_an_ended_request_gives_its_blocks_back_while_its_caller_still_holds_it(tiny):
    """The loop lets an ended request's session go itself: a caller still holding the request
    (an HTTP stream being written) holds no blocks, so a later request may take the whole pool
    without anything being collected first."""
    model = _pool_of(slots=2, blocks=3)
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0)
    first = _run(scheduler, _ask(tokens(30, seed=1), new=10, seed=1))[0]
    assert first.session is None and model.pool.free_blocks == 3 and model.pool.free_slots == 2
    second = _run(scheduler, _ask(tokens(30, seed=2), new=18, seed=2))[0]     # 48 rows: the 3 blocks
    assert second.got == _alone(tiny, second) and scheduler.preemptions == 0
    assert first.got == _alone(tiny, first)


def test_a_busy_key_lets_another_keys_later_request_in_first(tiny):
    scheduler = Scheduler(tiny, max_sessions=4, spare_sessions=0)
    busy = [_ask([1, 2], key="busy", seed=i) for i in range(6)]
    late = _ask([3, 4], key="late")
    scheduler.waiting.extend(busy + [late])
    scheduler._take_waiting()
    assert [r.key for r in scheduler.running] == ["busy", "busy", "late", "busy"]
    assert list(scheduler.waiting) == busy[3:]


def test_with_requests_decoding_a_turns_prompt_share_follows_the_measured_times(tiny):
    from hebrus.scheduling.scheduler import MIN_CHUNK
    scheduler = Scheduler(tiny, prefill_tokens=512, prefill_share=2.0, spare_sessions=0)
    decoders, feeding = [_ask([1, 2]) for _ in range(31)], _ask(list(range(3, 900)))
    for decoding in decoders:
        decoding.fed = 2
    scheduler.running += decoders + [feeding]
    assert scheduler._prompt_budget() == 512                    # nothing measured yet
    scheduler.pace.token_s, scheduler.pace.step_s = 1e-3, 50e-3         # a step costs 50 prompt tokens' time
    assert scheduler._prompt_budget() == 100
    # a step beside chunks costs 60 prompt tokens' time, alone 50: a turn within 3 steps alone
    scheduler.pace.step_s, scheduler.pace.alone_s, scheduler.pace.alone_width = 60e-3, 50e-3, 31
    assert scheduler._prompt_budget() == 90
    scheduler.pace.alone_width = 8                              # a step alone seen only of 8: not this one
    assert scheduler._prompt_budget() == 120
    scheduler.pace.alone_width, scheduler.passes = 31, "two"    # steps alone each turn: the fitted step is one
    assert scheduler._prompt_budget() == 120
    scheduler.passes, scheduler.decode = "one", "graph"         # steps alone replay graphs: another route
    assert scheduler._prompt_budget() == 120
    scheduler.decode = "eager"
    scheduler.pace.alone_s, scheduler.pace.alone_width = None, 0
    scheduler.pace.step_s = 1e-3
    assert scheduler._prompt_budget() == MIN_CHUNK              # (its part by head count: 512 // 32)
    del scheduler.running[:28]                                  # 3 decoding, 1 prefilling: its part, 128
    assert scheduler._prompt_budget() == 128
    scheduler.running = [feeding]                               # no one decoding: the whole budget
    assert scheduler._prompt_budget() == 512
    scheduler.running = decoders + [feeding]
    scheduler.pace.token_s = 0.0                                # a token measured at 0 s says nothing
    assert scheduler._prompt_budget() == 512
    with pytest.raises(ValueError, match="positive"):
        Scheduler(tiny, prefill_share=0.0)


def test_a_long_prompt_fed_in_shares_while_others_decode_answers_as_alone(tiny):
    scheduler = Scheduler(tiny, chunk_size=256, prefill_tokens=512, prefill_share=0.5, spare_sessions=0)
    requests = [_ask(tokens(8, seed=1), new=30, seed=1, key="a"), _ask(SHARED[:400], new=3, seed=2, key="b")]
    _together(scheduler, requests)
    assert scheduler.pace.token_s is not None and scheduler.pace.step_s is not None
    for request in requests:
        assert request.got == _alone(tiny, request)


@pytest.mark.parametrize("host_bytes", [1 << 30, 0])
def test_preempted_constrained_requests_answer_as_they_do_alone(tiny, host_bytes):
    """Constrained requests (a regular expression long enough to need the pool's blocks) are
    preempted and come back with their constraint where it stood (copied with the state, or
    made again from their tokens); each answers exactly as the engine does alone under it, and
    its copies (n = 2) as requests with the next seed do."""
    pytest.importorskip("llguidance")
    from hebrus.text.grammar import Grammar
    grammar = Grammar.regex("[a-z]{40}")
    model = _pool_of(slots=10, blocks=12)
    scheduler = Scheduler(model, chunk_size=16, prefill_tokens=64, spare_sessions=0, cache_bytes=0,
                          preempt_host_bytes=host_bytes)
    requests = []
    for s in range(3):
        parent, copy = _ask(tokens(30, seed=s), new=40, key=f"k{s}", seed=s), _ask(tokens(30, seed=s), new=40, seed=s + 1)
        for r in (parent, copy):
            r.constraint = grammar.start(model.tokenizer, model.spec.vocab_size)
        parent.copies = [copy]
        requests += [parent, copy]
    _together(scheduler, requests[0::2])
    assert scheduler.preemptions > 0
    for request in requests:
        alone = list(tiny.session().generate(request.prompt, max_new_tokens=40, temperature=0.8, seed=request.seed,
                                             constraint=grammar.start(tiny.tokenizer, tiny.spec.vocab_size)))
        assert request.got == alone and bytes(alone).isalpha()


def test_a_request_of_n_choices_takes_n_places(tiny):
    """Running and waiting, a request counts its copies: one of 3 choices waits while 2 of the
    3 places are held, and runs alone when it is larger than all of them."""
    from hebrus.scheduling.scheduler import Overloaded

    def asking(seed: int, n: int) -> Request:
        request = _ask(tokens(5, seed=seed), seed=seed)
        request.copies = [_ask(tokens(5, seed=seed), seed=seed + j) for j in range(1, n)]
        return request
    scheduler = Scheduler(tiny, max_sessions=3, max_waiting=5, spare_sessions=0, cache_bytes=0)
    first, second, big = asking(1, 1), asking(2, 1), asking(3, 3)
    for r in (first, second, big):
        scheduler.submit(r)
    with pytest.raises(Overloaded):                 # 5 places wait: 2 more pass max_waiting
        scheduler.submit(asking(4, 2))
    scheduler._take_waiting()
    assert scheduler.running == [first, second] and list(scheduler.waiting) == [big]
    scheduler.running.clear()
    scheduler.waiting.clear()
    huge = asking(5, 5)
    scheduler.submit(huge)                          # alone, it is admitted whatever its n
    scheduler._take_waiting()
    assert scheduler.running == [huge]
