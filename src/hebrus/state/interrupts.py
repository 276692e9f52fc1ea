"""Publication is not torn by Ctrl-C.

Python runs signal handlers in the main thread between bytecodes, so a `KeyboardInterrupt` can
land between copying the output to the caller and flipping the public record, leaving the two
disagreeing. Inside `deferred_interrupts()` a SIGINT is held and delivered to the original
handler when the block ends, after the publication is complete. Other threads never receive
Python-level signals, so there nothing needs deferring.
"""
from __future__ import annotations

import signal
import threading


class deferred_interrupts:
    """Context manager: hold SIGINT for the duration of the block (main thread only)."""

    __slots__ = ("_original", "_held", "_active")

    def __enter__(self) -> "deferred_interrupts":
        self._original, self._held, self._active = None, [], True
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                self._original = handler
                signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        if self._active:
            self._held.append((signum, frame))
        else:                                        # restoring was itself interrupted
            self._original(signum, frame)

    def __exit__(self, *exc_info) -> bool:
        self._active = False
        if self._original is not None:
            signal.signal(signal.SIGINT, self._original)
            for signum, frame in self._held:
                self._original(signum, frame)        # may raise KeyboardInterrupt, now harmless
        return False
