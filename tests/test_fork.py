"""`Session.fork`: a new session at the same frontier, banked state copied and row logs shared
(nothing copied at the fork), after which parent and fork diverge without seeing each other."""
from __future__ import annotations

import gc

import pytest
import torch

import hebrus

TEXT = list(b"When shall we three meet again")


def _fed(model, *chunks):
    s = model.session()
    for ids in chunks:
        s.feed(ids)
    return s


def test_a_fork_shares_rows_and_then_diverges_in_isolation(tiny):
    parent = _fed(tiny, TEXT[:12])
    fork = parent.fork()
    assert fork.digest() == parent.digest() and fork.frontier == 12
    assert fork.image.public.table == parent.image.public.table           # the same blocks
    fork_digest = fork.digest()
    a = parent.feed(TEXT[12:15])
    assert fork.digest() == fork_digest                       # the parent's new rows are not the fork's
    b = fork.feed(TEXT[20:22])
    want_a, want_b = _fed(tiny, TEXT[:12], TEXT[12:15]), _fed(tiny, TEXT[:12], TEXT[20:22])
    assert parent.digest() == want_a.digest() and torch.equal(a, want_a.logits)
    assert fork.digest() == want_b.digest() and torch.equal(b, want_b.logits)
    again = fork.fork()                                       # a fork of a fork
    again.feed(TEXT[:1])
    assert fork.digest() == want_b.digest() and parent.digest() == want_a.digest()
    assert again.digest() == _fed(tiny, TEXT[:12], TEXT[20:22], TEXT[:1]).digest()


def test_a_fork_with_its_own_rows_leaves_the_parent_stepping_in_place(tiny):
    """`fork(copy_rows=True)`: the fork holds a copy of the rows up to the frontier, the parent
    keeps its blocks unshared (it can go on stepping in place); both then go on as the same
    chunks fed from scratch give."""
    parent = _fed(tiny, TEXT[:12])
    fork = parent.fork(copy_rows=True)
    assert fork.digest() == parent.digest() and fork.frontier == 12
    assert parent.image.room() and fork.image.room()
    assert not set(fork.image.public.table) & set(parent.image.public.table)
    table = parent.image.public.table
    a = parent.feed(TEXT[12:13])
    assert parent.image.public.table == table                                 # stepped in place
    b = fork.feed(TEXT[20:22])
    want_a, want_b = _fed(tiny, TEXT[:12], TEXT[12:13]), _fed(tiny, TEXT[:12], TEXT[20:22])
    assert parent.digest() == want_a.digest() and torch.equal(a, want_a.logits)
    assert fork.digest() == want_b.digest() and torch.equal(b, want_b.logits)


def test_forking_copies_no_rows_whatever_the_context(tiny):
    """A fork takes no block; its first chunk copies one (the shared block it writes into) and
    takes what it grows into, whatever the context length."""
    for length in (4, 200):
        parent = _fed(tiny, (TEXT * 10)[:length])
        gc.collect()
        free = tiny.pool.free_blocks
        fork = parent.fork()
        assert fork.image.public.table == parent.image.public.table and tiny.pool.free_blocks == free
        fork.feed(TEXT[:1])
        assert tiny.pool.free_blocks >= free - 1 - len(parent.image.public.table)
        changed = [i for i, (a, b) in enumerate(zip(fork.image.public.table, parent.image.public.table)) if a != b]
        assert changed == [length // tiny.pool.block_rows]
        del parent, fork                          # their blocks go back before the next length's count


def test_an_aborted_chunk_on_a_fork_leaves_both_as_they_were(tiny):
    parent = _fed(tiny, TEXT[:8])
    fork = parent.fork()
    digest = parent.digest()
    with hebrus.inject(stage="layers.1.qsa", kind="nonfinite"):
        with pytest.raises(hebrus.NonFiniteError):
            fork.feed(TEXT[8:11])
    with hebrus.inject(stage="head", kind="structural"):
        with pytest.raises(hebrus.StructuralError):
            parent.feed(TEXT[8:11])
    assert fork.digest() == parent.digest() == digest
    assert torch.equal(fork.feed(TEXT[8:11]), parent.feed(TEXT[8:11]))


def test_forks_decode_from_the_plan_and_in_batches(tiny_fast):
    parent = tiny_fast.session(decode="planned")
    parent.feed(TEXT[:10])
    forks = [parent.fork() for _ in range(3)]
    steps = [fork.feed([t]) for fork, t in zip(forks, (1, 2, 3))]      # each copies its rows first
    for fork, t, got in zip(forks, (1, 2, 3), steps):
        torch.testing.assert_close(got, _fed(tiny_fast, TEXT[:10], [t]).logits, rtol=1e-5, atol=1e-5)
    outs = hebrus.feed_many(forks + [parent], [4, 5, 6, 7])
    for s, history, got in zip(forks + [parent], ([1, 4], [2, 5], [3, 6], [7]), outs):
        torch.testing.assert_close(got, _fed(tiny_fast, TEXT[:10], *[[t] for t in history]).logits,
                                   rtol=1e-5, atol=1e-5)
