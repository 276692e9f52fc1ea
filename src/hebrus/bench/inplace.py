"""The in-place variants that price the transaction: the same stages against one bank written in
place (no second bank, no seal, no validation, no status word). Measurement only, never a
product path."""
from __future__ import annotations

import weakref

import torch

from hebrus.engine.graphs import Inputs, fine_widths, step_key
from hebrus.state.context import InPlace
from hebrus.state.image import Image
from hebrus.state.pool import Log
from hebrus.state.step import StepBatch


def _run(model, ctx, step: StepBatch) -> None:
    ctx.held = []
    try:
        for stage in model.stages:
            stage.run(ctx, step)
    except BaseException:
        for resource in ctx.held:
            resource.release()
        raise
    for resource in ctx.held:                   # in place: whatever was brought in stays
        resource.commit()


class _Captured:
    """The capture policy of the in-place variants, the engine's own: a planned step runs
    uncaptured once, then is captured and replayed; storage that changed drops the graph."""

    def __init__(self):
        self.graph, self.captured_for, self.warm = None, None, False

    def step(self, planned, storages: list[torch.Tensor]) -> None:
        if self.graph is not None and any(a is not b for a, b in zip(self.captured_for, storages)):
            self.graph = None
        if self.graph is None and self.warm:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                planned()
            self.captured_for = storages
        if self.graph is None:
            planned()
            self.warm = True
        else:
            self.graph.replay()


class InPlaceSession:
    """A session that overwrites its state in place: measurement only, never a product path.
    With `graphs`, its one-token steps are captured as a CUDA graph the way a transactional
    session's are (same plan, same storage policy), so the two are compared like for like."""

    def __init__(self, model, graphs: bool = False):
        self.model, self.graphs = model, graphs
        self.image = Image(model.pool)                 # for its slot's bank 0; its rows are its own
        self.bank = self.image.banks[0]
        self.names = [spec.name for spec in self.image.appended]
        self.storages = [torch.zeros((0, *spec.shape), dtype=spec.dtype, device=model.device)
                         for spec in self.image.appended]
        self.frontier = 0
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)
        self.captured = _Captured()

    def feed(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.int64)
        with torch.inference_mode():
            if self.graphs and len(ids) == 1 and all(st.shape[0] > self.frontier for st in self.storages):
                self.token.copy_(ids)
                self.captured.step(self._planned, list(self.storages))
            else:
                ids = ids.to(self.model.device)
                _run(self.model, _InPlaceContext(self, ids, self.frontier), StepBatch.chunk(ids, self.frontier))
                self.bank["frontier"].fill_(self.frontier + len(ids))
        self.frontier += len(ids)
        return self.bank["logits"].clone()

    def _planned(self) -> None:
        start = self.bank["frontier"].view(1)
        _run(self.model, _InPlaceContext(self, self.token, start), StepBatch(self.token, start, (1,), None))
        self.bank["frontier"].add_(1)


class InPlaceBatch:
    """In-place sessions stepped together, one token each, as the engine's runner steps a batch
    (`engine.graphs`: the same lanes of ids, positions, slots, parities and block tables, the
    same graph per lanes and table width) with every write in place: one bank, no checks, no
    second copy of anything. Measurement only. The sessions' rows move into blocks of the pool."""

    def __init__(self, sessions: list[InPlaceSession], graphs: bool = False):
        self.sessions, self.model, self.graphs = sessions, sessions[0].model, graphs
        pool = self.pool = self.model.pool
        self.fine = fine_widths(self.model)          # the runner's widths
        self.tables = []
        for s in sessions:
            table = pool.writable((), 0, s.frontier).table
            for name, storage in zip(s.names, s.storages):
                pool.write_rows(name, table, 0, storage[:s.frontier])
            self.tables.append(table)
        weakref.finalize(self, _release, pool, self.tables)      # the blocks go back with the batch
        self.inputs: dict[tuple, Inputs] = {}
        self.captured: dict[tuple, _Captured] = {}

    def feed(self, tokens) -> torch.Tensor:
        pool, n = self.pool, len(self.sessions)
        for i, s in enumerate(self.sessions):        # as a transaction takes blocks: as a step begins
            table, held = self.tables[i], len(self.tables[i]) * pool.block_rows
            if held <= s.frontier:
                self.tables[i] = table + pool.extend(table, max(s.frontier + 1, 2 * held, pool.block_rows))
        key = step_key(pool, [s.frontier for s in self.sessions], 1, False, self.fine)
        inputs = self.inputs.get(key)
        if inputs is None:
            inputs = self.inputs[key] = Inputs(pool, key[0], 1, key[2], False)
        inputs.fill([(s.frontier, 0, s.image.slot, t) for s, t in zip(self.sessions, self.tables)],
                    torch.as_tensor(tokens).tolist())
        with torch.inference_mode():
            step = lambda: self._planned(inputs)
            if self.graphs:
                self.captured.setdefault(key, _Captured()).step(step, [])
            else:
                step()
        for s in self.sessions:
            s.frontier += 1
        return pool.banks["logits"][0, inputs.step.slots[:n]]

    def _planned(self, inputs: Inputs) -> None:
        ctx = _InPlaceLanes(self.pool, inputs.step)
        _run(self.model, ctx, inputs.step)
        after = inputs.step.positions + 1
        ctx.write("frontier", after if ctx.lanes > 1 else after[0])


def _release(pool, tables: list) -> None:
    for table in tables:
        pool.release(table)


class _Unchecked:
    """What both in-place contexts share: no checks, resources held until `_run` commits them."""

    def hold(self, resource):
        self.held.append(resource)

    def flag(self, bad, bit):
        pass

    def check_range(self, values, upper, bit, lower=0):
        pass


class _InPlaceLanes(_Unchecked):
    """A lanes step's context, in place: banked owners read from and written to bank 0 of each
    lane's slot, rows through each lane's table."""

    def __init__(self, pool, step: StepBatch):
        self.pool, self.step, self.lanes = pool, step, step.sessions

    def read(self, name):
        value = self.pool.banks[name][self.step.parities, self.step.slots]
        return value[0] if self.lanes == 1 else value

    def write(self, name, value):
        bank = self.pool.banks[name]
        value = value.to(bank.dtype)
        bank.index_put_((self.step.parities, self.step.slots), value.unsqueeze(0) if self.lanes == 1 else value)

    def rows(self, name):
        return [Log(self.pool.rows[name], self.step.tables[i], first=None) for i in range(self.lanes)]

    def in_place(self, name):
        """As a transaction's kernels read and write the banks where they lie: here the same bank."""
        return InPlace(self.pool.banks[name], self.step.parities, self.step.parities, self.step.slots)

    def wrote(self, name, check):
        pass


class _InPlaceContext(_Unchecked):
    def __init__(self, owner: InPlaceSession, ids: torch.Tensor, start):
        self.owner, self.start, self.length = owner, start, len(ids)

    def read(self, name):
        return self.owner.bank[name]

    def write(self, name, value):
        self.owner.bank[name].copy_(value)

    def rows(self, name):
        i = self.owner.names.index(name)
        storage, need = self.owner.storages[i], self.owner.frontier + self.length
        if storage.shape[0] < need:                 # as a transaction grows it (never in a graph)
            capacity = min(self.owner.model.spec.max_context, max(need, 2 * storage.shape[0], 16))
            grown = torch.zeros((capacity,) + tuple(storage.shape[1:]), dtype=storage.dtype, device=storage.device)
            grown[: self.start].copy_(storage[: self.start])
            self.owner.storages[i] = storage = grown
        return [Log.whole(storage, None if isinstance(self.start, torch.Tensor) else need)]


def copies(first, count: int):
    """`first` and count-1 sessions holding a copy of its published state (so a batch's sessions
    need one prefill): in-place sessions copied, transactional ones forked with rows of their
    own. A measurement shortcut, never a product path."""
    out = [first]
    for _ in range(count - 1):
        if isinstance(first, InPlaceSession):
            other = InPlaceSession(first.model)
            for name, value in first.bank.items():
                other.bank[name].copy_(value)
            other.storages = [st.clone() for st in first.storages]
            other.frontier = first.frontier
        else:
            other = first.fork(copy_rows=True)
        out.append(other)
    return out
