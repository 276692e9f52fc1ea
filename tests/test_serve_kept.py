"""`serve.kept.Kept` on its own, with stand-in sessions whose bytes the test names: the longest
kept prefix of the asking key's own, least recently used evicted per key and overall, the bytes
counted exactly. And /metrics behind the API key, /health open."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hebrus

from hebrus.serve.kept import Kept, _session_bytes


def session(size: int, name: str = ""):
    return SimpleNamespace(size=size, name=name)


def kept(budget: int = 1000, per_key: int | None = None) -> Kept:
    return Kept(budget, per_key, size_of=lambda s: s.size)


def held(k: Kept) -> list[tuple[str, list[int]]]:
    """What `k` holds, least recently used first."""
    return [(key, list(tokens)) for key, tokens in k.entries]


def test_the_longest_kept_prefix_wins():
    k = kept()
    short, long, other = session(10), session(10), session(10)
    k.put("a", [1, 2], short)
    k.put("a", [1, 2, 3, 4], long)
    k.put("a", [1, 9, 9], other)
    assert k.find("a", [1, 2, 3, 4, 5]) == (long, 4)
    assert k.find("a", [1, 2, 3, 5]) == (short, 2)
    assert k.find("a", [1, 9, 9, 9]) == (other, 3)
    assert k.find("a", [2, 1]) == (None, 0)


def test_another_key_never_sees_an_entry():
    k = kept()
    k.put("a", [1, 2, 3], session(10))
    assert k.find("b", [1, 2, 3, 4]) == (None, 0)
    assert k.find("", [1, 2, 3, 4]) == (None, 0)


def test_a_prompt_equal_to_the_kept_tokens_is_found_and_a_shorter_one_is_not():
    k = kept()
    s = session(10)
    k.put("a", [1, 2, 3], s)
    assert k.find("a", [1, 2, 3]) == (s, 3)
    assert k.find("a", [1, 2]) == (None, 0)
    assert k.find("a", []) == (None, 0)


def test_find_makes_an_entry_the_most_recently_used():
    k = kept(budget=30)
    first, second, third = session(10), session(10), session(10)
    k.put("a", [1], first)
    k.put("a", [2], second)
    k.put("b", [3], third)
    assert k.find("a", [1, 5]) == (first, 1)
    assert held(k) == [("a", [2]), ("b", [3]), ("a", [1])]
    assert list(k.own["a"]) == [(2,), (1,)]
    k.put("b", [4], session(10))                # over the budget: the least recently used goes
    assert held(k) == [("b", [3]), ("a", [1]), ("b", [4])]


def test_a_key_over_its_share_loses_its_own_oldest_and_no_other_keys():
    k = kept(budget=100, per_key=30)
    k.put("b", [9], session(20))
    for i in range(1, 5):
        k.put("a", [i], session(10))
    assert held(k) == [("b", [9]), ("a", [2]), ("a", [3]), ("a", [4])]
    assert k.used_by == {"a": 30, "b": 20} and k.used == 50
    k.put("a", [5, 5], session(25))            # drops a's oldest until it fits its share
    assert held(k) == [("b", [9]), ("a", [5, 5])]
    assert k.used_by == {"a": 25, "b": 20} and k.used == 45


def test_the_whole_budget_evicts_the_least_recently_used_of_any_key():
    k = kept(budget=40, per_key=30)
    k.put("a", [1], session(15))
    k.put("b", [2], session(15))
    k.put("a", [3], session(15))                # a: 30, its share; all: 45, over the budget
    assert held(k) == [("b", [2]), ("a", [3])]
    assert k.used_by == {"a": 15, "b": 15} and k.used == 30
    k.put("c", [4], session(30))
    assert held(k) == [("c", [4])] and k.used_by == {"c": 30} and k.used == 30
    assert k.find("a", [3]) == (None, 0) and "a" not in k.own


def test_an_entry_over_its_keys_share_or_the_budget_is_not_kept():
    k = kept(budget=100, per_key=30)
    k.put("a", [1], session(10))
    k.put("a", [2], session(31))
    k.put("b", [3], session(101))
    assert held(k) == [("a", [1])] and k.used == 10
    assert not kept(budget=0).entries


def test_putting_the_same_tokens_again_replaces_without_counting_twice():
    k = kept(budget=100)
    old, new = session(40, "old"), session(30, "new")
    k.put("a", [1, 2], old)
    k.put("a", [1, 2], new)
    assert held(k) == [("a", [1, 2])] and dict(k.entries)[("a", (1, 2))] == (new, 30)
    assert k.used == k.used_by["a"] == 30
    assert k.find("a", [1, 2, 3]) == (new, 2)
    k.put("b", [1, 2], old)                     # the same tokens under another key are its own
    assert k.used == 70 and k.used_by == {"a": 30, "b": 40}


def test_budgets_below_zero_are_refused():
    with pytest.raises(ValueError, match="at least 0"):
        Kept(-1)
    with pytest.raises(ValueError, match="at least 0"):
        Kept(10, per_key=-1)


def test_a_sessions_bytes_are_its_slot_and_the_blocks_its_table_holds():
    from hebrus.state.pool import Pool
    model = hebrus.load("tiny")
    session = model.session()
    session.feed(list(range(20)))                       # 20 rows: two blocks of 16
    slot, block = Pool.slot_bytes(model.owners), Pool.block_bytes(model.owners, model.pool.block_rows)
    assert _session_bytes(session) == slot + 2 * block
    k = Kept(10 ** 9)
    k.put("a", [1], session)
    assert k.used == slot + 2 * block


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
    assert client.get("/health").json() == {"status": "ok"}


def test_metrics_is_open_without_keys(app_of):
    client = app_of(None)
    reply = client.get("/metrics")
    assert reply.status_code == 200 and "hebrus_queue_depth" in reply.text
