"""Fault injection: arm one failure of a given kind after a named stage.

    with hebrus.inject(stage="layers.1.gdn", kind="nonfinite"):
        session.feed(ids)            # raises hebrus.NonFiniteError; nothing is published

Each kind is produced by driving the real mechanism, so it is detected by the same check that
catches the real failure: the allocator refuses, a NaN is written into a private tensor, the
stage's completion record is marked unfinished, a status bit is set by the status op, or an
exception is raised inside the stage's wrapper. Arming is scoped to the `with` block (a context
variable); when nothing is armed, `after` is one lookup.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from hebrus.errors import FAULT_KINDS, InvalidInput
from hebrus.state.status import Status

_armed: ContextVar[tuple["Fault", ...]] = ContextVar("hebrus_armed_faults", default=())


class InjectedFault(RuntimeError):
    """The exception a `structural` injection raises inside a stage."""


@dataclass(slots=True)
class Fault:
    stage: str
    kind: str
    fired: bool = False


@contextmanager
def inject(stage: str, kind: str) -> Iterator[Fault]:
    """Arm one `kind` failure for the next transaction that reaches `stage`."""
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise InvalidInput(f"unknown fault kind {kind!r}; kinds are: {', '.join(FAULT_KINDS)}")
    if not isinstance(stage, str) or not stage:
        raise InvalidInput("stage must be a stage name such as 'layers.0.gdn' (see model.stages)")
    fault = Fault(stage, kind)
    token = _armed.set(_armed.get() + (fault,))
    try:
        yield fault
    finally:
        _armed.reset(token)


def armed() -> tuple[Fault, ...]:
    return tuple(f for f in _armed.get() if not f.fired)


def after(stage: str, txn) -> None:
    """Injection point, called after every stage of every transaction."""
    faults = _armed.get()
    if not faults:
        return
    for fault in faults:
        if not fault.fired and fault.stage == stage:
            fault.fired = True
            _FIRE[fault.kind](txn)


def _structural(txn) -> None:
    raise InjectedFault(f"injected structural fault after {txn.stage}")


def _nonfinite(txn) -> None:
    txn.poison()


def _alloc(txn) -> None:
    txn.budget.refuse_next()


def _command(txn) -> None:
    txn.completion.mark_incomplete(txn.stage_index)


def _status(txn) -> None:
    txn.flag(torch.ones((), dtype=torch.bool, device=txn.device), Status.INJECTED)


_FIRE = {"structural": _structural, "nonfinite": _nonfinite, "alloc": _alloc,
         "command": _command, "status": _status}


class _FailingRows:
    """A paged table's source whose next read fails as a broken file would."""

    def __init__(self, source, table):
        self.source, self.table = source, table
        self.shape, self.dtype, self.nbytes = source.shape, source.dtype, source.nbytes

    def _fail(self):
        self.table.source = self.source             # one read fails; the next ones work
        from hebrus.errors import PageReadError
        raise PageReadError("injected page read failure")

    def read(self, start, stop):
        self._fail()

    def take(self, ids):
        self._fail()

    def with_dtype(self, dtype):
        return self.source.with_dtype(dtype)


@contextmanager
def page_read_failure(model) -> Iterator[None]:
    """The next page read of any of `model`'s paged tables fails (the `command` kind's cause for
    tables read in pages: `hebrus.weights.pages`). Reads happen on cache misses: a model with
    no page frames (`model.with_paging(0)`) reads at every lookup."""
    if not model.paged:
        raise InvalidInput("this model keeps its PLE tables resident: load it with ple_cache_bytes to page them")
    tables = list(model.paged.values())
    saved = [t.source for t in tables]
    for t in tables:
        t.source = _FailingRows(t.source, t)
    try:
        yield
    finally:
        for t, source in zip(tables, saved):
            t.source = source
