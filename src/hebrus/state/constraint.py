"""A constraint on the tokens a session takes: one more owner of the session, held on the host
in its published record (`Published.constraint`) and published by the same flip as every other.

The seam knows nothing of what a constraint means (a grammar, a JSON schema: `hebrus.text.grammar`
makes them); it asks only this of one. A value is never changed: a chunk's transaction takes
`after(its tokens)`, a new value, into the record its flip publishes, so an aborted chunk leaves
the public value as it was and nothing is undone.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Constraint(Protocol):
    def allows(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, may come next (all of them: len(tokens))."""

    def after(self, tokens: Sequence[int]) -> "Constraint":
        """The value once `tokens` (which `allows` all of) have come; this one unchanged."""

    def mask(self) -> torch.Tensor:
        """The tokens that may come next, as bits: an int32 tensor on the CPU, token i allowed
        where bit i % 32 of word i // 32 is set (words past the vocabulary ignored)."""

    @property
    def finished(self) -> bool:
        """Whether nothing may come next: the constrained text is complete."""


def masks(values: list[Constraint]) -> list[torch.Tensor]:
    """Each value's `mask()`; values of one type that offers `masks` (a static method over a
    list of them) compute theirs together."""
    kinds = {type(v) for v in values}
    if len(kinds) == 1 and hasattr(next(iter(kinds)), "masks"):
        return next(iter(kinds)).masks(values)
    return [v.mask() for v in values]


class Made:
    """What `ahead` started: `join()` waits until its work is done (or failed)."""

    def __init__(self):
        self.done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)


class _Worker:
    """One daemon thread that runs the work `ahead` hands it, in the order given: starting a
    thread a step cost about 65 µs on a 2-core machine, handing work to this one about 12. A
    process forked from this one starts its own on first use."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="hebrus-masks", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done = self._queue.get()
            try:
                work()
            except Exception:                   # noqa: BLE001 - done again, where it is needed
                pass
            finally:
                done.set()

    def put(self, work) -> Made:
        made = Made()
        self._queue.put((work, made.done))
        return made


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def ahead(pairs: list[tuple[Constraint, int]]) -> Made | None:
    """Start making, on a thread apart (one for the process: `_Worker`), each value after its
    token and its mask: what the step that feeds those tokens will publish and the next choice
    will need, computed while the step runs (the masks' library works without the
    interpreter's lock). Join what it returns before the next choice; a failure there only
    leaves the work to be done then."""
    global _worker
    if not pairs:
        return None
    with _worker_lock:
        if _worker is None or _worker.pid != os.getpid():
            _worker = _Worker()
    return _worker.put(lambda: masks([value.after([token]) for value, token in pairs]))


def checked(value) -> Constraint | None:
    """`value` if it is a constraint (or None); else TypeError naming what one needs."""
    if value is None or isinstance(value, Constraint):
        return value
    raise TypeError(f"a constraint needs allows, after, mask and finished; got {type(value).__name__}")
