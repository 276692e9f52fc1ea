"""A pass that runs a few stages at a time: `Paced(work)` runs `work()` on a thread of its own,
and `advance(n)` lets it go on for `n` more stages, waiting until it stops between two of them
(or ends). One thread runs at a time: the caller's waits while the pass runs, and the pass's
waits, parked between stages, while the caller does other work (the serving loop steps its
decoding requests there). The pass does exactly what it would in one call, in the same order:
the stages only wait longer between them.

    pass = Paced(lambda: feed_many(sessions, chunks))
    while not pass.advance(3):      # three stages, then the decoders' step
        step_the_decoders()
    results = pass.outcome()

`engine.eager.run_stages` calls `between_stages()` after each stage it seals; outside a paced
pass that does nothing. The sessions a paced pass feeds are locked by its thread until it ends:
nothing else may touch them meanwhile (the loop leaves them out of everything else). The pass
runs in a copy of the context it was made in (a fault armed there is armed in it).
"""
from __future__ import annotations

import contextvars
import threading
from typing import Callable

_here = threading.local()       # .paced: the `Paced` whose thread this is


def between_stages() -> None:
    """Where a paced pass waits for its next `advance` (a stage is sealed). Nothing elsewhere."""
    paced = getattr(_here, "paced", None)
    if paced is not None:
        paced._between()


class Paced:
    def __init__(self, work: Callable[[], object]):
        self._work = work
        self._context = contextvars.copy_context()  # what the caller's thread sees (armed faults)
        self._go = threading.Semaphore(0)           # the pass may run
        self._back = threading.Semaphore(0)         # the pass has stopped (between stages, or at its end)
        self._left = 0                              # stages to run before stopping (None: to the end)
        self._result: object = None
        self._error: BaseException | None = None
        self.done = False
        self.stages = 0                             # stages run so far
        self._thread = threading.Thread(target=self._run, name="hebrus-paced-pass", daemon=True)

    def advance(self, stages: int | None = None) -> bool:
        """Let the pass run `stages` more stages (at least one; None: to its end) and wait until
        it stops. True once it has ended."""
        if self.done:
            return True
        if stages is not None and stages < 1:
            raise ValueError(f"a paced pass advances at least one stage at a time, got {stages}")
        self._left = stages
        if not self._thread.is_alive():
            self._thread.start()
        self._go.release()
        self._back.acquire()
        return self.done

    def outcome(self) -> object:
        """What `work()` returned (it is run to its end first); what it raised is raised."""
        self.advance(None)
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self) -> None:
        _here.paced = self
        self._go.acquire()
        try:
            self._result = self._context.run(self._work)
        except BaseException as exc:        # handed to the caller's thread (`outcome`)
            self._error = exc
        finally:
            _here.paced = None
            self.done = True
            self._back.release()

    def _between(self) -> None:
        self.stages += 1
        if self._left is None:
            return
        self._left -= 1
        if self._left <= 0:
            self._back.release()
            self._go.acquire()
