"""A pass that runs a few stages at a time: `Paced(work)` runs `work()` as a greenlet (a stack of
its own on the caller's thread), and `advance(n)` lets it go on for `n` more stages, returning
once it stops between two of them (or ends). The caller does other work meanwhile (the serving
loop steps its decoding requests there). The pass does exactly what it would in one call, in the
same order: its stages only wait longer between them.

    flight = Paced(lambda: feed_many(sessions, chunks))
    while not flight.advance(3):    # three stages, then the decoders' step
        step_the_decoders()
    results = flight.outcome()

One thread, not two: a second thread computing on the CPU brings a second team of OpenMP
workers, and each team's idle workers spin while the other's run (a decode step took twice its
time beside a pass parked on another thread, 16 sessions of `shakespeare`). torch's grad and
inference modes are the thread's, so while the pass waits the caller's are restored.

`engine.eager.run_stages` calls `between_stages()` after each stage it seals (but in a planned
step, which holds its runner's lock: a pass of one token each from CUDA graphs runs whole);
outside a paced pass that does nothing. The sessions a paced pass feeds are its own until it
ends: nothing else may touch them meanwhile (a call on one from the caller's side is refused as
"session busy": the pass holds its lock on the same thread; the serving loop leaves them out of
everything else). The pass runs in a copy of the context it was made in (a fault armed there is
armed in it); `advance` is called from the thread that made it.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable

import greenlet
import torch


def between_stages() -> None:
    """Where a paced pass waits for its next `advance` (a stage is sealed). Nothing elsewhere."""
    paced = getattr(greenlet.getcurrent(), "paced", None)
    if paced is not None:
        paced._between()


class _Pass(greenlet.greenlet):
    paced: "Paced | None" = None


class Paced:
    def __init__(self, work: Callable[[], object]):
        self._work = work
        self._context = contextvars.copy_context()  # what the caller sees (armed faults)
        self._left: int | None = 0                  # stages to run before stopping (None: to the end)
        self._modes = (False, True)                 # the caller's inference and grad modes
        self._result: object = None
        self._error: BaseException | None = None
        self.done = False
        self.stages = 0                             # stages run so far
        # the seconds each stage took, then those from the last stage to the pass's end (its
        # validation and publication): the host's time, not the time it waited between them
        self.seconds: list[float] = []
        self._mark = 0.0
        self._pass = _Pass(self._run)
        self._pass.paced = self

    def advance(self, stages: int | None = None) -> bool:
        """Let the pass run `stages` more stages (at least one; None: to its end) and wait until
        it stops. True once it has ended."""
        if self.done:
            return True
        if stages is not None and stages < 1:
            raise ValueError(f"a paced pass advances at least one stage at a time, got {stages}")
        try:
            self._pass.parent = greenlet.getcurrent()   # where it comes back to: this caller
        except ValueError:
            raise RuntimeError("a paced pass advances only on the thread that made it") from None
        self._left = stages
        self._modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self._mark = time.perf_counter()
        # the caller's modes back however the pass stops: parked (`_between` sets them too) or ended
        with torch.inference_mode(self._modes[0]), torch.set_grad_enabled(self._modes[1]):
            self._pass.switch()
        return self.done

    def outcome(self) -> object:
        """What `work()` returned (it is run to its end first); what it raised is raised."""
        self.advance(None)
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self) -> None:
        try:
            self._result = self._context.run(self._work)
        except Exception as exc:            # handed to the caller (`outcome`); anything else (an
            self._error = exc               # interrupt) is raised in the caller at once
        finally:
            self.seconds.append(time.perf_counter() - self._mark)
            self._pass.paced = None
            self.done = True

    def _between(self) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self._mark)
        self._mark = now
        self.stages += 1
        if self._left is None:
            return
        self._left -= 1
        if self._left <= 0:
            inference, grad = self._modes
            # torch's modes are the thread's: while the pass waits, the caller's are back
            with contextlib.ExitStack() as modes:
                modes.enter_context(torch.inference_mode(inference))
                modes.enter_context(torch.set_grad_enabled(grad))
                self._pass.parent.switch()
