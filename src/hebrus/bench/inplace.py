"""The in-place variants that price the transaction: the same stages against one bank written in
place (no second bank, no seal, no validation, no status word). Measurement only, never a
product path."""
from __future__ import annotations

import torch

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
        _run(self.model, _InPlaceContext(self, self.token, start), StepBatch.planned(self.token, start))
        self.bank["frontier"].add_(1)


class InPlaceBatch:
    """In-place sessions stepped together, one token each: the batched pass of `hebrus.Batch`
    with every write in place (measurement only). With `graphs`, steps are captured as a CUDA
    graph once every row log holds its row, as `hebrus.Batch` captures them."""

    def __init__(self, sessions: list[InPlaceSession], graphs: bool = False):
        self.sessions, self.model, self.graphs = sessions, sessions[0].model, graphs
        self.tokens = torch.zeros(len(sessions), dtype=torch.int64, device=self.model.device)
        self.captured = _Captured()

    def feed(self, tokens) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        with torch.inference_mode():
            roomy = all(st.shape[0] > s.frontier for s in self.sessions for st in s.storages)
            if self.graphs and roomy:
                self.tokens.copy_(ids)
                self.captured.step(self._planned, [st for s in self.sessions for st in s.storages])
            else:
                ids, starts = ids.to(self.model.device), [s.frontier for s in self.sessions]
                _run(self.model, _InPlaceBatchContext(self.sessions, ids, starts), StepBatch.tokens(ids, starts))
                for s in self.sessions:
                    s.bank["frontier"].fill_(s.frontier + 1)
        for s in self.sessions:
            s.frontier += 1
        return torch.stack([s.bank["logits"] for s in self.sessions])

    def _planned(self) -> None:
        starts = [s.bank["frontier"].view(1) for s in self.sessions]
        _run(self.model, _InPlaceBatchContext(self.sessions, self.tokens, starts), StepBatch.tokens(self.tokens, starts))
        for s in self.sessions:
            s.bank["frontier"].add_(1)


class _Unchecked:
    """What both in-place contexts share: no checks, resources held until `_run` commits them."""

    def hold(self, resource):
        self.held.append(resource)

    def flag(self, bad, bit):
        pass

    def check_range(self, values, upper, bit, lower=0):
        pass


class _InPlaceBatchContext(_Unchecked):
    def __init__(self, sessions: list[InPlaceSession], ids: torch.Tensor, starts):
        self.parts = [_InPlaceContext(s, ids[i:i + 1], start) for i, (s, start) in enumerate(zip(sessions, starts))]

    def read(self, name):
        return torch.stack([p.read(name) for p in self.parts])

    def write(self, name, value):
        for p, v in zip(self.parts, value):
            p.write(name, v)

    def rows(self, name):
        return [p.rows(name)[0] for p in self.parts]


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
