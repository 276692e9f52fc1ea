"""Publication is not torn by a signal.

Python runs signal handlers in the main thread between bytecodes, so a handler that raises
(Ctrl-C's `KeyboardInterrupt`, a timeout's exception, `SystemExit` on SIGTERM) could land between
copying the output to the caller and flipping the public record, leaving the two disagreeing.
Inside `deferred_signals()` the Python-level handlers of the usual signals are held, and each
held signal is delivered to its own handler when the block ends, after the publication is
complete. Other threads never run Python-level handlers, so there nothing needs deferring.

Handlers are read and swapped through `_signal`, the C module under `signal`: the same calls
without `signal`'s conversions of numbers to enums, which cost 29 µs of a decode step's host work
(six reads and a swap each way, every step) against under 5 µs here (both on one core of a 2-core CI machine).
"""
from __future__ import annotations

import _signal
import os
import signal
import threading

DEFERRED = tuple(int(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1", "SIGUSR2")
                 if hasattr(signal, name))


class deferred_signals:
    """Context manager: hold the Python-level handlers of `DEFERRED` for the block (main
    thread only); deliver what arrived, in order, when it ends. A block inside another swaps no
    handler: the outer one holds every signal until it ends (so a step's publications, each in
    its own block, cost one swap in all)."""

    __slots__ = ("_originals", "_held", "_active")
    _outer: "deferred_signals | None" = None         # the main thread's outermost open block

    def __enter__(self) -> "deferred_signals":
        self._originals, self._held, self._active = {}, [], True
        if deferred_signals._outer is not None or threading.current_thread() is not threading.main_thread():
            return self
        try:
            deferred_signals._outer = self
            for signum in DEFERRED:
                handler = _signal.getsignal(signum)
                if callable(handler):
                    self._originals[signum] = handler
                    _signal.signal(signum, self._hold)
        except BaseException:                        # a handler ran (and raised) while installing
            self._active = False
            deferred_signals._outer = None
            self._restore()
            raise
        return self

    def _hold(self, signum, frame) -> None:
        if self._active:
            self._held.append((signum, frame))
        else:                                        # restoring was itself interrupted
            self._originals[signum](signum, frame)

    def __exit__(self, *exc_info) -> bool:
        self._active = False
        if deferred_signals._outer is not self:      # nested, or another thread's: nothing held
            return False
        try:
            self._restore()
        finally:
            deferred_signals._outer = None
            self._deliver()
        return False

    def _restore(self) -> None:
        """Put every original handler back, even if a signal interrupts one of the calls."""
        pending = list(self._originals.items())
        while pending:
            signum, handler = pending.pop()
            try:
                _signal.signal(signum, handler)
            except BaseException:
                for other, original in pending:
                    _signal.signal(other, original)
                raise

    def _deliver(self) -> None:
        """Run the held signals' handlers; if one raises, the later ones are sent again so
        their handlers still run (from the next bytecode on)."""
        for i, (signum, frame) in enumerate(self._held):
            try:
                self._originals[signum](signum, frame)
            except BaseException:
                for later, _ in self._held[i + 1:]:
                    os.kill(os.getpid(), later)
                raise
