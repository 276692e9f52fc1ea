"""Concurrent callers of one session: state-dependent checks and every read of public state
happen under the session lock, so no caller sees or builds a state that was never published.

Each race is forced, not hoped for: one thread is parked at a chosen point (a Gate) while the
other runs until it finishes or blocks on the lock.
"""
import threading
import time
import types

import pytest
import torch

import hebrus
import hebrus.state.image
from hebrus.state.image import Image
from conftest import PATIENCE, tokens
from races import Gate, WatchedLock, Worker


def _short(tiny, mode="exact"):
    model = hebrus.Model(tiny.config.replace(max_context=64), dict(tiny.named_parameters()), mode=mode)
    return model


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_room_is_checked_under_the_lock(tiny, monkeypatch, mode):
    """Finding: two threads each passed the context-room check before either published, and
    the session ended at frontier 70 with max_context 64."""
    s = _short(tiny, mode).session()
    gate = Gate(park=lambda: threading.get_ident() == a.ident)
    real = hebrus.Session._check_room

    def check_then_park(self, count):
        real(self, count)
        gate()

    monkeypatch.setattr(hebrus.Session, "_check_room", check_then_park)
    WatchedLock.install(s)
    a = Worker(lambda: s.feed(tokens(40, seed=1)))
    a.start()
    assert gate.arrived.wait(PATIENCE)
    b = Worker(lambda: s.feed(tokens(30, seed=2)))
    b.start()
    b.wait_settled()                      # b published, or waits for the lock a holds
    gate.release()
    a.finish(), b.finish()
    assert a.error is None
    assert isinstance(b.error, hebrus.InvalidInput) and "context limit of 64" in str(b.error)
    assert s.frontier == 40


def test_digest_sees_one_published_image(tiny, monkeypatch):
    """Finding: a digest taken while another thread fed hashed a bank the next transaction was
    already writing, and matched no state ever published."""
    s = tiny.session()
    s.feed(tokens(5, seed=3))
    chunks = [tokens(3, seed=4), tokens(4, seed=5)]
    valid = _digests_along(tiny, tokens(5, seed=3), chunks)
    reader = Worker(s.digest)
    updates = {"n": 0}
    gate = Gate(park=lambda: threading.get_ident() == reader.ident and updates["n"] == 6)

    class ParkingHash:
        def __init__(self):
            self._h = _sha256()

        def update(self, data):
            updates["n"] += 1
            gate()
            self._h.update(data)

        def hexdigest(self):
            return self._h.hexdigest()

    _sha256 = hebrus.state.image.hashlib.sha256
    monkeypatch.setattr(hebrus.state.image, "hashlib", types.SimpleNamespace(sha256=ParkingHash))
    WatchedLock.install(s)
    reader.start()
    assert gate.arrived.wait(PATIENCE)
    writer = Worker(lambda: [s.feed(c) for c in chunks])
    writer.start()
    writer.wait_settled()
    gate.release()
    reader.finish(), writer.finish()
    assert writer.error is None and reader.error is None
    assert reader.result in valid
    monkeypatch.undo()
    assert s.digest() in valid and s.frontier == 12


def _digests_along(model, warm, chunks):
    ref = model.session()
    ref.feed(warm)
    seen = {ref.digest()}
    for chunk in chunks:
        ref.feed(chunk)
        seen.add(ref.digest())
    return seen


@pytest.mark.parametrize("call", ["feed", "prefill"])
def test_returned_logits_belong_to_the_callers_chunk(tiny, monkeypatch, call):
    """Finding: feed()/prefill() read the session's logits after releasing the lock, so a
    delayed thread could return another thread's logits. Thread A parks right after its chunk
    publishes, while B waits for the lock; if A then reads the logits through the `logits`
    property (outside the transaction) it parks there too, until B has published."""
    s = tiny.session()
    mine, theirs = tokens(6, seed=6), tokens(5, seed=7)
    expected = tiny.session().feed(mine)
    a = Worker(lambda: getattr(s, call)(mine))
    published = Gate(park=lambda: threading.get_ident() == a.ident)
    late_read = Gate(park=lambda: threading.get_ident() == a.ident)
    real_publish, real_logits = Image.publish, hebrus.Session.logits

    def publish_then_park(self, record):
        real_publish(self, record)
        published()

    def park_then_read(self):
        late_read()
        return real_logits.fget(self)

    monkeypatch.setattr(Image, "publish", publish_then_park)
    monkeypatch.setattr(hebrus.Session, "logits", property(park_then_read))
    WatchedLock.install(s)
    a.start()
    assert published.arrived.wait(PATIENCE)
    b = Worker(lambda: s.feed(theirs))
    b.start()
    b.wait_settled()                      # b waits for the lock a holds
    published.release()
    _until(lambda: not a.is_alive() or late_read.arrived.is_set())
    if late_read.arrived.is_set():        # a reads outside its transaction: let b publish first
        b.finish()
    late_read.release()
    a.finish(), b.finish()
    assert a.error is None and b.error is None
    assert torch.equal(a.result, expected)


def _until(condition, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.001)


def test_logits_property_reads_one_published_image(tiny):
    s = tiny.session()
    s.feed(tokens(4, seed=8))
    WatchedLock.install(s)
    lock_held = s._lock.acquire()
    reader = Worker(lambda: s.logits)
    reader.start()
    reader.wait_settled()
    assert reader.result is None, "logits must wait for a running transaction"
    s._lock.release()
    reader.finish()
    assert lock_held and torch.equal(reader.result, s.logits)


def test_prefill_chunks_are_not_interleaved_with_other_callers(tiny, monkeypatch):
    """prefill holds the lock for all its chunks: another caller's chunk lands before or
    after the whole call, never between two of its chunks."""
    s = tiny.session()
    long, other = tokens(20, seed=9), tokens(3, seed=10)
    embed = next(st for st in tiny.stages if st.name == "embed")
    real_run, calls = embed.run, []
    gate = Gate(park=lambda: threading.get_ident() == a.ident and len(calls) == 1)

    def counting(txn, step):
        calls.append(1)
        real_run(txn, step)
        gate()

    monkeypatch.setattr(embed, "run", counting)
    WatchedLock.install(s)
    a = Worker(lambda: s.prefill(long, chunk_size=8))
    a.start()
    assert gate.arrived.wait(PATIENCE)
    b = Worker(lambda: s.feed(other))
    b.start()
    b.wait_settled()
    gate.release()
    a.finish(), b.finish()
    assert a.error is None and b.error is None
    ref = tiny.session()
    ref.feed(long + other)
    assert s.digest() == ref.digest()
