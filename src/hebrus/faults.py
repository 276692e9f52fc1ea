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

`rank=r` targets rank r of a tensor-parallel model (`hebrus.parallel`): the fault travels with
the next call to that rank's process and fires there; every rank then raises the same error.
"""
from __future__ import annotations

import os
import signal
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
RANK = 0            # this process's rank of a tensor-parallel model (a worker's is set as it starts)


@dataclass(slots=True)
class Fault:
    stage: str
    kind: str
    session: object = None                  # a `Session` whose part of a step it targets, or None
    fired: bool = False
    rank: int = 0                           # the rank whose process it fires in


@contextmanager
def inject(stage: str, kind: str, session=None, rank: int = 0) -> Iterator[Fault]:
    """Arm one `kind` failure for the next transaction that reaches `stage` (with `session`, the
    next one that holds that session's chunk, targeted at it; with `rank`, on that rank of a
    tensor-parallel model)."""
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise InvalidInput(f"unknown fault kind {kind!r}; kinds are: {', '.join(FAULT_KINDS)}")
    if not isinstance(stage, str) or not stage:
        raise InvalidInput("stage must be a stage name such as 'layers.0.gdn' (see model.stages)")
    if session is not None and not hasattr(session, "image"):
        raise InvalidInput(f"session must be a hebrus session or None, got {type(session).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidInput(f"rank must be a rank's number (0, 1, ...), got {rank!r}")
    with arm(Fault(stage, kind, session, rank=rank)) as fault:
        yield fault


@contextmanager
def arm(fault: Fault) -> Iterator[Fault]:
    """`fault` armed for the `with` block."""
    token = _armed.set(_armed.get() + (fault,))
    try:
        yield fault
    finally:
        _armed.reset(token)


@contextmanager
def armed_as(armed: list[Fault]) -> Iterator[None]:
    """Exactly these faults armed for the `with` block (a worker's, sent with a call)."""
    token = _armed.set(tuple(armed))
    try:
        yield
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
        if fault.fired or fault.stage != stage or fault.rank != RANK:
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


def _killed(txn, session) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hung(txn, session) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


# the five kinds; and for a tensor-parallel rank's loss (`hebrus.parallel.lose`), the rank's process killed or stopped
_FIRE = {"structural": _structural, "nonfinite": _nonfinite, "alloc": _alloc,
         "command": _command, "status": _status, "killed": _killed, "hung": _hung}


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
