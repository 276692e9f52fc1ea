"""The state pool's allocator (`state/pool.py`): slots and reference-counted blocks.

A stateful hypothesis run drives sessions that open, step (publishing or aborting), fork and
close over one small pool, against a reference that keeps each session's rows and bank as plain
lists. After every operation: each session reads back exactly its own rows and bank (forks
share blocks and copy on write, so neither side sees the other's later steps), and the pool
never leaks: free blocks + held blocks = all blocks, the references held = the blocks the
sessions' tables name, free slots + live sessions = all slots. HEBRUS_HYPOTHESIS=long runs far
more examples.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hebrus.state.owners import APPENDED, OwnerSpec
from hebrus.state.pool import Pool, PoolFull

LONG = os.environ.get("HEBRUS_HYPOTHESIS") == "long"
SPECS = [OwnerSpec("state", (3,), torch.float64, fill=-1.0), OwnerSpec("rows", (2,), torch.float64, APPENDED)]


class Session:
    def __init__(self, slot: int):
        self.slot, self.parity, self.frontier, self.table = slot, 0, 0, ()
        self.rows: list[float] = []         # the reference: row r holds [v, -v]
        self.state = -1.0                   # the reference bank: every entry this value


class Sessions(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = Pool(SPECS, torch.device("cpu"), slots=4, blocks=10, block_rows=3)
        self.live: list[Session] = []
        self.counter = 0.0

    @rule()
    def open(self):
        try:
            slot, _ = self.pool.take_slot()
        except PoolFull:
            assert len(self.live) == self.pool.slots
            return
        self.live.append(Session(slot))

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 7), rows=st.integers(0, 7), publish=st.booleans())
    def step(self, which, rows, publish):
        s = self.live[which % len(self.live)]
        free = self.pool.free_blocks
        try:
            plan = self.pool.writable(s.table, s.frontier, rows)
        except PoolFull:
            assert self.pool.free_blocks == free                    # nothing taken
            return
        self.pool.copy_blocks(plan.copies)
        values = [self.counter + i for i in range(rows)]
        self.counter += rows
        if rows:
            self.pool.write_rows("rows", plan.table, s.frontier, torch.tensor([[v, -v] for v in values],
                                                                               dtype=torch.float64))
        self.pool.banks["state"][1 - s.parity, s.slot] = self.counter       # the private bank
        if not publish:
            self.pool.release(plan.taken)                           # an abort: the step's blocks go back
            return
        self.pool.release(plan.dropped)                             # the flip: the copies replace them
        s.table, s.frontier, s.parity = plan.table, s.frontier + rows, 1 - s.parity
        s.rows += values
        s.state = self.counter

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 7))
    def fork(self, which):
        parent = self.live[which % len(self.live)]
        try:
            slot, _ = self.pool.take_slot()
        except PoolFull:
            return
        child = Session(slot)
        self.pool.copy_slot(parent.slot, parent.parity, slot)
        child.parity, child.frontier, child.table = parent.parity, parent.frontier, self.pool.share(parent.table)
        child.rows, child.state = list(parent.rows), parent.state
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 7))
    def close(self, which):
        s = self.live.pop(which % len(self.live))
        self.pool.release(s.table)
        self.pool.free_slot(s.slot)

    @invariant()
    def each_session_reads_its_own_state(self):
        for s in self.live:
            got = self.pool.read_rows("rows", s.table, s.frontier)
            assert got.tolist() == [[v, -v] for v in s.rows]
            assert self.pool.banks["state"][s.parity, s.slot].tolist() == [s.state] * 3

    @invariant()
    def nothing_leaks(self):
        held = self.pool.held()
        assert self.pool.free_blocks + len(held) == self.pool.blocks
        tables: dict[int, int] = {}
        for s in self.live:
            assert len(s.table) == self.pool.blocks_for(s.frontier)
            for block in s.table:
                tables[block] = tables.get(block, 0) + 1
        assert held == tables
        assert self.pool.free_slots + len(self.live) == self.pool.slots


Sessions.TestCase.settings = settings(
    max_examples=1000 if LONG else 300, stateful_step_count=60 if LONG else 40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_sessions = Sessions.TestCase


def test_a_fork_costs_no_rows_and_its_first_step_copies_one_block():
    pool = Pool(SPECS, torch.device("cpu"), slots=2, blocks=8, block_rows=4)
    parent = pool.writable((), 0, 6)                        # rows 0..5: two blocks, the second half full
    assert len(parent.taken) == 2 and not parent.copies
    table = pool.share(parent.table)                         # the fork: no block taken
    assert pool.free_blocks == 6
    step = pool.writable(table, 6, 1)                        # row 6 lands in the shared second block
    assert step.copies == ((parent.table[1], step.table[1]),) and step.dropped == (parent.table[1],)
    assert step.table[0] == parent.table[0]                  # the full block stays shared


def test_carving_a_pool_from_bytes():
    per_slot, per_block = Pool.slot_bytes(SPECS), Pool.block_bytes(SPECS, 16)
    assert (per_slot, per_block) == (2 * 3 * 8, 16 * 2 * 8)
    padding = per_slot + 2 * per_block                      # a planned step's padding lanes: one slot, two blocks
    pool = Pool.carve(SPECS, torch.device("cpu"), 10 * per_slot + 5 * per_block + padding, 1024, slots=10)
    assert (pool.slots, pool.blocks) == (10, 5) and pool.nbytes() == 10 * per_slot + 5 * per_block + padding
    half = Pool.carve(SPECS, torch.device("cpu"), 4096, 1024)
    assert half.slots == (4096 - padding) // 2 // per_slot and half.nbytes() <= 4096
    short = Pool.carve(SPECS, torch.device("cpu"), 10 * per_slot + 500 * per_block + padding, 32, slots=10)
    assert short.blocks == 10 * 2                           # no more than every slot's table at 32 rows
    with pytest.raises(PoolFull, match="do not fit"):
        Pool.carve(SPECS, torch.device("cpu"), per_slot + padding, 1024, slots=2)


def test_a_slot_taken_again_holds_every_owners_fill_in_both_banks_and_its_views_are_the_pools():
    """Whatever a slot's last session left, taking it again resets each owner's value in both
    banks to its fill (owners that start at zero are reset together, the others one by one), and
    the views handed back are the pool's own memory; the other slots are untouched."""
    specs = [OwnerSpec("zero", (2, 3), torch.float32), OwnerSpec("count", (4,), torch.int64),
             OwnerSpec("history", (3,), torch.int64, fill=9), OwnerSpec("minus", (2,), torch.float64, fill=-1.5)]
    pool = Pool(specs, torch.device("cpu"), slots=2, blocks=0, block_rows=1)
    first, _ = pool.take_slot()
    other, _ = pool.take_slot()
    for bank in pool.banks.values():
        bank[:, :2] = 7                                      # what the sessions left, both slots
    pool.free_slot(first)
    slot, views = pool.take_slot()
    assert slot == first and len(views) == 2
    for spec in specs:
        for parity in (0, 1):
            value = views[parity][spec.name]
            assert value.data_ptr() == pool.banks[spec.name][parity, slot].data_ptr()
            assert bool((value == spec.fill).all()), (spec.name, parity)
        assert bool((pool.banks[spec.name][:, other] == 7).all())


def test_blocks_taken_together_are_zeroed_together_and_never_after_they_are_given_back():
    """Inside `zeroing_together` the blocks a thread takes are zeroed when it ends (one fill per
    storage), nested blocks leaving it to the outermost; a block given back meanwhile and taken
    by another thread, which wrote into it, keeps what that thread wrote."""
    import threading
    pool = Pool(SPECS, torch.device("cpu"), slots=2, blocks=8, block_rows=4)
    storage = pool.rows["rows"]
    storage.fill_(7.0)                                       # whatever earlier owners left
    with pool.zeroing_together():
        kept = pool.writable((), 0, 6).table                 # two blocks
        with pool.zeroing_together():
            more = pool.extend(kept, 12)                     # a third, from the nested block
        given = pool.writable((), 0, 1).table                # one more, given back below
        assert bool((storage[list(kept + more)] == 7.0).all())      # not zeroed yet
        pool.release(given)
        other = []
        thread = threading.Thread(target=lambda: other.append(pool.writable((), 0, 1).table))
        thread.start()
        thread.join()
        assert other[0] == given                             # the same block, taken by another thread:
        assert bool((storage[list(given)] == 0).all())       # zeroed there, at once
        storage[list(given)] = 5.0                           # and written by it
    assert bool((storage[list(kept + more)] == 0).all())
    assert bool((storage[list(given)] == 5.0).all())


def test_an_eager_step_of_several_sessions_writes_every_row_in_one_write_where_each_session_would():
    """`StepBatch.put` of sessions whose logs share the pool's storage writes each token's row
    through its session's table in one write (the places made once for every owner of the pass);
    each session writing its own rows (its twin, taken where a log keeps a gathered copy) leaves
    the same storage, and each session hears its rows (by token: [T, ...])."""
    from hebrus.state.pool import Log
    from hebrus.state.step import StepBatch
    pool = Pool(SPECS, torch.device("cpu"), slots=3, blocks=12, block_rows=3)
    tables = [(4, 7), (0, 1, 2, 9), (11,)]                  # not consecutive, consecutive, one block
    starts, lengths = (1, 2, 0), (4, 7, 2)
    step = StepBatch.ragged(torch.zeros(sum(lengths), dtype=torch.int64), starts, lengths)
    value = torch.arange(sum(lengths) * 2, dtype=torch.float64).view(-1, 2) + 1

    def logs(storage):
        heard = []
        out = [Log(storage, torch.tensor(t), t, s + n) for t, s, n in zip(tables, starts, lengths)]
        for i, log in enumerate(out):
            log.written = lambda rows, by_token=False, i=i: heard.append((i, by_token, rows.shape[0]))
        return out, heard

    # (the pool's storage is not zeroed until a block is handed out: its bytes might read as NaN,
    # which no comparison finds equal to itself)
    together, heard = logs(torch.zeros_like(pool.rows["rows"]))
    where = step.placed(together)
    assert where is not None and step.placed(logs(pool.rows["rows"])[0]) is where     # once for the tables
    step.put(together, value)
    assert heard == [(0, True, sum(lengths))]
    alone, heard = logs(torch.zeros_like(pool.rows["rows"]))
    alone[0].upto(2)                                          # a gathered copy: each session writes its own
    assert step.placed(alone) is None
    step.put(alone, value)
    assert heard == [(i, False, n) for i, n in enumerate(lengths)]
    assert torch.equal(together[0].storage, alone[0].storage)
    for i, log in enumerate(together):
        assert torch.equal(log.upto(starts[i] + lengths[i])[starts[i]:], step.rows_of(i, value))
        assert all(step.rows_of(i, where.tables)[:, :len(tables[i])].eq(torch.tensor(tables[i])).all(1))


def test_rows_read_where_they_lie_are_the_rows_gathered_whole():
    """`Log.picking` on a table of scattered blocks (`TabledRows`): the rows asked for, each as
    the whole gather (`Log.all`) holds it, without gathering the rest; per-row scales beside
    their codes read the same way (`QuantizedRows`). On consecutive blocks it is a view.
    (The model-level twin: planned and eager steps against the exact mode, tests/test_batch.py.)"""
    from hebrus.ops.quant import QuantizedRows
    from hebrus.state.pool import Log, TabledRows
    g = torch.Generator().manual_seed(3)
    storage = torch.randn(12, 4, 2, 3, generator=g)                       # 12 blocks of 4 rows [2, 3]
    scales = torch.rand(12, 4, 2, generator=g)                            # a scale a head of a row
    table = torch.tensor([7, 2, 9, 0, 5])
    log, scale_log = Log(storage, table, first=None), Log(scales, table, first=None)
    rows = torch.tensor([[0, 3, 4, 19], [18, 5, 5, 11]])
    picked = log.picking()
    assert isinstance(picked, TabledRows) and picked.shape == log.all().shape and picked.dim() == 3
    assert torch.equal(picked[rows], log.all()[rows])
    early = torch.tensor([[0, 3], [6, 5]])                               # rows below 7
    assert log.picking(7).shape == log.upto(7).shape and log.picking(7)[early].equal(log.upto(7)[early])
    quantized = QuantizedRows.of(picked, scale_log.picking(), torch.float64)
    assert torch.equal(quantized[rows], QuantizedRows.of(log.all(), scale_log.all(), torch.float64)[rows])
    with pytest.raises(ValueError, match="trailing"):
        picked.unsqueeze(0)
    whole = Log(storage, torch.tensor([3, 4, 5]), host=(3, 4, 5))
    view = whole.picking()
    assert isinstance(view, torch.Tensor) and view.data_ptr() == storage[3].data_ptr()
    assert torch.equal(view, whole.all()) and torch.equal(whole.picking(5), whole.upto(5))
