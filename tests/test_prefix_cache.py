"""`scheduling.prefix.PrefixCache` on its own, with stand-in sessions whose slot and blocks the
test names: the nearest kept state at or below where a prompt leaves the cached tokens, the cut,
each space its own, least recently used evicted per space and overall, the bytes counted exactly
(a slot each, a block once however many entries share it). And /metrics behind the API key,
/health open."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import hebrus
from hebrus.scheduling.prefix import PrefixCache

SLOT, BLOCK = 10, 1


def session(*blocks: int, name: str = ""):
    pool = SimpleNamespace(slot_nbytes=SLOT, block_nbytes=BLOCK)
    return SimpleNamespace(image=SimpleNamespace(pool=pool, public=SimpleNamespace(table=tuple(blocks))), name=name)


def cache(budget: int = 1000, every: int = 4, per_holder: int | None = None) -> PrefixCache:
    return PrefixCache(budget, every, per_holder)


def held(c: PrefixCache) -> list[tuple[str, list[int]]]:
    """What `c` holds, least recently used first."""
    return [(e.space, list(e.tokens)) for e in c.entries.values()]


def found(c: PrefixCache, space, prompt) -> tuple:
    hit = c.find(space, prompt)
    return hit.session, hit.length, hit.cut


def test_the_nearest_kept_state_at_or_below_the_shared_prefix_wins():
    c = cache(every=4)
    at4, at8, at10 = session(), session(), session()
    prompt = list(range(1, 13))
    c.put("a", prompt[:4], at4)
    c.put("a", prompt[:8], at8)
    c.put("a", prompt[:10], at10)
    assert found(c, "a", prompt) == (at10, 10, 10)              # past every kept state
    assert found(c, "a", prompt[:9] + [99]) == (at8, 8, 9)      # leaves the cached tokens at 9
    assert found(c, "a", prompt[:6] + [99, 99]) == (at4, 4, 6)  # inside the second block
    assert found(c, "a", prompt[:3] + [99]) == (None, 0, 3)     # before the first kept state
    assert found(c, "a", [99]) == (None, 0, 0)
    assert found(c, "a", prompt[:10]) == (at10, 10, 10) and found(c, "a", prompt[:8]) == (at8, 8, 8)


def test_a_tail_on_the_way_down_is_found_when_the_prompt_leaves_a_longer_entry_deeper():
    """A state kept inside a block (a tail) at a node the walk passes through, not the last:
    a prompt that follows a longer entry's blocks past it, then leaves them before any deeper
    kept state, gets the tail."""
    c = cache(every=4)
    prompt = list(range(1, 13))
    at6, at12 = session(), session()
    c.put("a", prompt[:6], at6)                 # a tail of the node at 4
    c.put("a", prompt[:12], at12)               # blocks 4..8 and 8..12 below it, nothing kept at 8
    assert found(c, "a", prompt[:9] + [99]) == (at6, 6, 9)
    assert found(c, "a", prompt) == (at12, 12, 12)


def test_a_cut_kept_once_is_found_by_the_next_prompt_sharing_as_much():
    """What the scheduler does on a first hit inside a block: the state at the cut is kept, so
    the next prompt sharing those tokens recomputes none."""
    c = cache(every=4)
    first = list(range(1, 11))
    c.put("a", first[:8], session())
    c.put("a", first, session())                # the first prompt's end
    second = first[:9] + [50, 51]
    _, length, cut = found(c, "a", second)
    assert (length, cut) == (8, 9)
    at9 = session()
    c.put("a", second[:cut], at9)
    assert found(c, "a", first[:9] + [60, 61]) == (at9, 9, 9)
    assert found(c, "a", first)[1:] == (10, 10)


def test_another_space_never_sees_an_entry():
    c = cache()
    c.put(("a", ""), [1, 2, 3, 4, 5], session())
    for space in (("b", ""), ("a", "salt"), ("", "")):
        assert found(c, space, [1, 2, 3, 4, 5, 6]) == (None, 0, 0)


def test_find_makes_an_entry_the_most_recently_used_and_counts_it():
    c = cache(budget=3 * SLOT)
    first, second, third = session(), session(), session()
    c.put("a", [1], first)
    c.put("a", [2], second)
    c.put("b", [3], third)
    assert found(c, "a", [1, 5])[0] is first
    assert held(c) == [("a", [2]), ("b", [3]), ("a", [1])]
    c.put("b", [4], session())                  # over the budget: the least recently used goes
    assert held(c) == [("b", [3]), ("a", [1]), ("b", [4])]
    assert (c.lookups, c.hits, c.saved) == (1, 1, 1)


def test_a_space_over_its_share_loses_its_own_oldest_and_no_other_spaces():
    c = cache(budget=100, per_holder=3 * SLOT)
    c.put("b", [9], session())
    for i in range(1, 5):
        c.put("a", [i], session())
    assert held(c) == [("b", [9]), ("a", [2]), ("a", [3]), ("a", [4])]
    assert c.used_by("a") == 3 * SLOT and c.used == 4 * SLOT


def test_an_entry_a_prompt_found_outlasts_a_burst_of_entries_never_found():
    """What a shared system prompt meets: the prefix all the clients hit, then each client's own
    ends, more than the budget holds. The ends go first, oldest first, and the prefix stays for
    the next prompt; once only entries that were found are left, the least recently used goes."""
    c = cache(budget=3 * SLOT, every=4)
    system = [1, 2, 3, 4, 5, 6]
    prefix = session(name="prefix")
    c.put("a", system, prefix)
    for i in range(5):
        assert found(c, "a", system + [10 + i])[0] is prefix
        c.put("a", system + [10 + i], session())
    assert found(c, "a", system + [99])[0] is prefix
    assert held(c) == [("a", system + [13]), ("a", system + [14]), ("a", system)]
    again = session()
    c.put("a", [7], again)
    assert found(c, "a", [7, 8])[0] is again and found(c, "a", system + [14])[1] == 7    # both found now
    c.put("a", [9], session())                  # none left never found but itself: the oldest found goes
    assert held(c) == [("a", [7]), ("a", system + [14]), ("a", [9])]
    assert c.shed() and held(c) == [("a", [7]), ("a", system + [14])]     # [9], never found, goes first


def test_states_found_long_ago_go_back_on_probation_and_a_new_prefix_is_found():
    """The protected segment holds at most PROTECTED of the budget's slots: entries found once
    long ago (finished conversations' ends) go back on probation as newer ones are found, so a
    new system prompt that clients start sharing is kept and found from its second client on."""
    c = cache(budget=6 * SLOT, every=4)
    for i in range(5):                          # five stale entries, each found once
        c.put("a", [100 + i] * 8, session())
        c.find("a", [100 + i] * 8 + [1])
    system, hits = list(range(1, 41)), []
    for j in range(20):                         # clients of a new system prompt, each its own end
        prompt = system + [500 + j, 501]
        hit = c.find("a", prompt)
        hits.append(hit.length)
        for mark in c.marks(hit.length, len(prompt), hit.cut):
            c.put("a", prompt[:mark], session())
    assert hits == [0] + [40] * 19 and len(c.protected) <= 0.75 * 6


def test_a_state_put_again_keeps_its_segment():
    c = cache(budget=4 * SLOT)
    c.put("a", [1, 2], session())
    c.find("a", [1, 2, 3])
    c.put("a", [1, 2], session(name="again"))
    assert [list(e.tokens) for e in c.protected.values()] == [[1, 2]] and not c.probation


def test_past_the_budget_a_quiet_space_over_its_share_loses_its_own_first():
    """A space that filled the budget alone and went quiet is past its share once another space
    holds entries: when the budget is full, its entries go before the newcomer's, found or not."""
    c = cache(budget=6 * SLOT, every=4, per_holder=2 * SLOT)
    for i in range(6):
        c.put("A", [100 + i] * 8, session())
        c.find("A", [100 + i] * 8 + [1])
    system, hits = list(range(1, 41)), []
    for j in range(10):
        prompt = system + [500 + j, 501]
        hit = c.find("B", prompt)
        hits.append(hit.length)
        for mark in c.marks(hit.length, len(prompt), hit.cut):
            c.put("B", prompt[:mark], session())
    assert hits == [0] + [40] * 9 and c.used_by("B") == 2 * SLOT and c.used <= c.budget


def test_a_space_alone_may_fill_the_budget_and_keeps_to_its_share_beside_another():
    """A share protects the other spaces: a space alone keeps entries past it, up to the budget;
    once another space holds an entry, its next entry brings it back within its share."""
    c = cache(budget=5 * SLOT, per_holder=2 * SLOT)
    for i in range(1, 5):
        c.put("a", [i], session())
    assert c.used_by("a") == 4 * SLOT
    c.put("b", [9], session())
    c.put("a", [5], session())
    assert held(c) == [("a", [4]), ("b", [9]), ("a", [5])] and c.used_by("a") == 2 * SLOT


def test_spaces_of_one_holder_keep_to_one_share():
    """Two spaces of holder "a" (a key's salts) count together against its share: filling
    them evicts their own oldest entry, never holder "b"'s."""
    c = PrefixCache(5 * SLOT, 4, 2 * SLOT, holder=lambda space: space[0])
    c.put(("b", ""), [9], session())
    for i, salt in enumerate("xyzw"):
        c.put(("a", salt), [i], session())
    assert held(c) == [(("b", ""), [9]), (("a", "z"), [2]), (("a", "w"), [3])]
    assert c.used_by("a") == 2 * SLOT and c.used_by("b") == SLOT
    assert found(c, ("b", ""), [9, 1])[1] == 1 and found(c, ("a", "x"), [0])[0] is None


def test_shared_blocks_count_once_and_go_with_their_last_entry():
    c = cache(budget=1000)
    c.put("a", [1, 2, 3, 4], session(7, 8))
    c.put("a", [1, 2, 3, 4, 5, 6], session(7, 8, 9))
    assert c.used == 2 * SLOT + 3 * BLOCK
    c.put("b", [1], session(7))
    assert c.used == 3 * SLOT + 3 * BLOCK and c.used_by("b") == SLOT + BLOCK
    c._drop(c.entries[next(iter(c.entries))])
    assert c.used == 2 * SLOT + 3 * BLOCK
    while c.shed():
        pass
    assert c.used == 0 and not c.roots and not c.blocks


def test_an_entry_over_its_spaces_share_beside_another_or_over_the_budget_is_not_kept():
    c = cache(budget=100, per_holder=30)
    c.put("b", [0], session())                  # another space holds an entry: the share applies
    c.put("a", [1], session())
    c.put("a", [2], session(*range(21)))
    c.put("c", [3], session(*range(91)))
    assert held(c) == [("b", [0]), ("a", [1])] and c.used == 2 * SLOT
    c = cache(budget=100, per_holder=30)
    c.put("a", [2], session(*range(21)))        # alone, only the budget bounds it
    c.put("a", [3], session(*range(91)))
    assert held(c) == [("a", [2])]
    c = cache(budget=0)
    c.put("a", [1], session())
    assert not c.entries and not c.keeps


def test_putting_the_same_tokens_again_replaces_without_counting_twice():
    c = cache(budget=100)
    old, new = session(1, name="old"), session(2, name="new")
    c.put("a", [1, 2], old)
    c.put("a", [1, 2], new)
    assert held(c) == [("a", [1, 2])] and found(c, "a", [1, 2, 3])[0] is new
    assert c.used == SLOT + BLOCK
    c.put("a", [1, 2, 3, 4], old)               # at a block's end: the node's own entry
    c.put("a", [1, 2, 3, 4], new)
    assert len(c.entries) == 2 and found(c, "a", [1, 2, 3, 4, 5])[0] is new


def test_marks_are_every_kth_position_the_cut_and_the_end():
    c = cache(every=4)
    assert c.marks(0, 10) == [4, 8, 10]
    assert c.marks(5, 10, cut=6) == [6, 8, 10]
    assert c.marks(8, 8 + 1) == [9]
    assert c.marks(3, 4, cut=9) == [4]


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="at least 0"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="at least 0"):
        PrefixCache(10, per_holder=-1)
    with pytest.raises(ValueError, match="at least 1"):
        PrefixCache(10, every=0)


def test_a_real_sessions_bytes_are_its_slot_and_its_blocks():
    from hebrus.state.pool import Pool
    model = hebrus.load("tiny")
    s = model.session()
    s.feed(list(range(20)))                       # 20 rows: two blocks of 16
    c = PrefixCache(10 ** 9)
    c.put("a", list(range(20)), s)
    assert c.used == Pool.slot_bytes(model.owners) + 2 * Pool.block_bytes(model.owners, model.pool.block_rows)


# ---- /metrics behind the API key -----------------------------------------------------------

@pytest.fixture
def app_of(tiny):
    pytest.importorskip("httpx")
    TestClient = pytest.importorskip("fastapi.testclient").TestClient
    from hebrus import serve
    schedulers = []

    def client(keys):
        app, scheduler = serve.build(tiny, "tiny", api_key=keys)
        schedulers.append(scheduler)
        return TestClient(app)
    yield client
    for scheduler in schedulers:
        scheduler.stop(drain_seconds=5)


def test_metrics_needs_a_key_when_the_server_has_keys(app_of):
    client = app_of(["key-a", "key-b"])
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}):
        reply = client.get("/metrics", headers=headers)
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"
        assert reply.json() == client.get("/v1/models", headers=headers).json()
    reply = client.get("/metrics", headers={"Authorization": "Bearer key-b"})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    assert "hebrus_requests_total" in reply.text and "hebrus_queue_depth" in reply.text
    assert "hebrus_prefix_cache_hits" in reply.text and "hebrus_prefix_cache_bytes" in reply.text
    assert "hebrus_prefix_cache_lost 0.0" in reply.text
    assert client.get("/health").json() == {"status": "ok"}


def test_metrics_is_open_without_keys(app_of):
    client = app_of(None)
    reply = client.get("/metrics")
    assert reply.status_code == 200 and "hebrus_queue_depth" in reply.text
