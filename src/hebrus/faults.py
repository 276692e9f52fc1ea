"""Fault injection: arm one failure of a given kind after a named stage.

    with hebrus.inject(stage="layers.1.gdn", kind="nonfinite"):
        session.feed(ids)            # raises hebrus.NonFiniteError; nothing is published

Each kind is produced by driving the real mechanism, so it is detected by the same check that
catches the real failure: the allocator refuses, a NaN is written into a private tensor, the
stage's completion record is marked unfinished, a status bit is set by the status op, or an
exception is raised inside the stage's wrapper. Arming is scoped to the `with` block (a context
variable); when nothing is armed, `after` is one lookup.

`session=s` targets one session's part of a step of several (`hebrus.feed_many`): `nonfinite`
poisons a value that stage wrote for s alone, `status` sets the bit in s's status word alone,
`alloc` arms s's own memory budget. Those three belong to s's rows, so s alone aborts and the
others publish. `structural` and `command` belong to the pass: every session of it aborts, and
the runner then runs each session alone; the fault stays armed for s until it has fired in a
step of s alone, so s fails again there and the innocent sessions publish.
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


PASS_KINDS = ("structural", "command")       # kinds that belong to a whole pass, not to one session's rows


@dataclass(slots=True)
class Fault:
    stage: str
    kind: str
    session: object = None                  # a `Session` whose part of a step it targets, or None
    fired: bool = False


@contextmanager
def inject(stage: str, kind: str, session=None) -> Iterator[Fault]:
    """Arm one `kind` failure for the next transaction that reaches `stage` (with `session`, the
    next one that holds that session's chunk, targeted at it)."""
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise InvalidInput(f"unknown fault kind {kind!r}; kinds are: {', '.join(FAULT_KINDS)}")
    if not isinstance(stage, str) or not stage:
        raise InvalidInput("stage must be a stage name such as 'layers.0.gdn' (see model.stages)")
    if session is not None and not hasattr(session, "image"):
        raise InvalidInput(f"session must be a hebrus session or None, got {type(session).__name__}")
    fault = Fault(stage, kind, session)
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
        if fault.fired or fault.stage != stage:
            continue
        if fault.session is None:
            fault.fired = True
            _FIRE[fault.kind](txn, None)
            continue
        target = next((i for i, p in enumerate(txn.parts) if p.image is fault.session.image), None)
        if target is None:
            continue
        # a pass kind stays armed until it fires in a step of its session alone
        fault.fired = fault.kind not in PASS_KINDS or txn.sessions == 1
        _FIRE[fault.kind](txn, target)


def _structural(txn, session) -> None:
    raise InjectedFault(f"injected structural fault after {txn.stage}")


def _nonfinite(txn, session) -> None:
    txn.poison(session)


def _alloc(txn, session) -> None:
    txn.parts[session or 0].budget.refuse_next()


def _command(txn, session) -> None:
    txn.completion.mark_incomplete(txn.stage_index)


def _status(txn, session) -> None:
    bad = torch.ones((), dtype=torch.bool, device=txn.device)
    if session is not None:
        bad = torch.arange(txn.sessions, device=txn.device) == session
    txn.flag(bad, Status.INJECTED)


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
