"""Deterministic thread races: park a chosen thread at a chosen point, and know when another
thread has either finished or is blocked on the session lock.

    gate = Gate()                       # a place where one thread parks until released
    a = Worker(lambda: s.feed(ids))     # runs in its own thread, keeps its result or error
    lock = WatchedLock.install(s)       # the session's lock, reporting who waits on it
    ...
    b.settled.wait()                    # b finished, or is parked, or waits for the lock

No test sleeps to make a race likely; every wait has a timeout so a broken test fails
instead of hanging.
"""
from __future__ import annotations

import threading

TIMEOUT = 300.0                  # seconds; a wait ends as soon as what it waits for happens


class Gate:
    """Parks the threads it is asked to park until `release()`."""

    def __init__(self, park=None):
        self.arrived = threading.Event()
        self._release = threading.Event()
        self._park = park or (lambda: True)

    def __call__(self) -> None:
        """Call this at the chosen point; it parks the calling thread if `park()` says so."""
        if not self._park():
            return
        worker = Worker.current()
        if worker is not None:
            worker.settled.set()
        self.arrived.set()
        if not self._release.wait(TIMEOUT):
            raise AssertionError("gate never released")

    def release(self) -> None:
        self._release.set()


class Worker(threading.Thread):
    """A thread that runs `fn` once and keeps what it returned or raised. `settled` is set
    when it finishes, parks at a gate, or blocks on a watched lock."""

    _by_ident: dict[int, "Worker"] = {}

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.settled = threading.Event()

    @classmethod
    def current(cls) -> "Worker | None":
        return cls._by_ident.get(threading.get_ident())

    def run(self) -> None:
        Worker._by_ident[threading.get_ident()] = self
        try:
            self.result = self.fn()
        except BaseException as exc:                  # noqa: BLE001 - kept for the test to inspect
            self.error = exc
        finally:
            self.settled.set()

    def wait_settled(self) -> None:
        if not self.settled.wait(TIMEOUT):
            raise AssertionError("worker neither finished nor blocked")

    def finish(self):
        self.join(TIMEOUT)
        if self.is_alive():
            raise AssertionError("worker did not finish")
        return self


class WatchedLock:
    """A drop-in for the session lock that marks a Worker settled while it waits."""

    def __init__(self):
        self._lock = threading.Lock()

    @classmethod
    def install(cls, session) -> "WatchedLock":
        session._lock = cls()
        return session._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        worker = Worker.current()
        if worker is not None:
            worker.settled.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc_info) -> None:
        self.release()
