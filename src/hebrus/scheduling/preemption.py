"""The requests the engine loop preempted for want of state-pool blocks, oldest first, and their
published states in host memory.

A preempted request's published state (consistent by construction) moves to host memory
(`Session.host_copy`) while all of theirs fit `host_bytes`; past that it is let go, and the
request is recomputed from its tokens when it comes back. A token it had chosen but not yet
committed stays with the request. Requests come back oldest first, once the pool has blocks for
their rows and a step more; what they produce is unchanged by it (exact mode: bit for bit).
"""
from __future__ import annotations

import collections
import gc
from typing import Callable, Iterator

from hebrus.errors import AllocationError, PoolExhausted


class Preempted:
    def __init__(self, host_bytes: int):
        self.requests: collections.deque = collections.deque()      # the engine loop's `Request`s, oldest first
        self.host_bytes = host_bytes    # at most this many bytes of their states in host memory
        self.held = 0                   # bytes of their states in host memory now
        self.count = 0                  # requests preempted so far (the bench, /metrics, tests)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(list(self.requests))

    def __contains__(self, request) -> bool:
        return request in self.requests

    def take(self, request) -> None:
        """Preempt `request`: its published state to host memory (or, past `host_bytes`, let go:
        it is recomputed from its tokens), its session let go, so that its slot and blocks
        return to the pool once nothing else holds it. The caller takes it out of its running
        requests after this returns: where the host copy fails, nothing has changed."""
        # the pool's bytes it holds bound its copy's (a slot's banks, whole blocks): `held` stays
        # within the budget
        if self.held + request.session.image.held_bytes() <= self.host_bytes:
            request.host = request.session.host_copy()
            self.held += request.host.nbytes
        request.session = None
        self.requests.append(request)
        self.count += 1

    def remove(self, request) -> None:
        """`request` out (ended while preempted, or back), its host copy let go."""
        self.requests.remove(request)
        self._let_go(request)

    def clear(self) -> None:
        for request in self.requests:
            self._let_go(request)
        self.requests.clear()

    def back(self, pool, running: int, places: int, shed: Callable[[], bool],
             restore: Callable) -> Iterator[tuple[object, BaseException | None]]:
        """The requests that come back now, oldest first, each taken out of this set as it is
        yielded: (request, None) with its session made again by `restore(request)`, or
        (request, the exception that fails it).

        One comes back while a place is free (`running` of `places` taken, counting those it
        brings back) and the pool has blocks for its rows, a step more and one for each running
        request's next rows (else it would be preempted again at once). Where the pool is short:
        it waits while others run (their blocks come back as they end) or while `shed()` gives
        back a prefix cache entry; alone, with nothing to shed, it fails (`PoolExhausted`).
        Where `restore` finds no memory now (`AllocationError`) it waits; any other failure of
        `restore` fails it alone."""
        while self.requests and running < places:
            request = self.requests[0]
            rows = request.fed + len(request.produced)

            def fits() -> bool:
                return pool.free_blocks >= pool.blocks_for(rows + 1) + running and pool.free_slots > 0
            if not fits():
                if running or shed():
                    return
                gc.collect()                        # sessions let go in reference cycles
                if not fits():                      # alone, and it still does not fit
                    self.remove(request)
                    yield request, PoolExhausted("resume", f"{rows} rows do not fit the state pool")
                    continue
            try:
                request.session = restore(request)
            except AllocationError:
                return
            except Exception as exc:                # it alone fails
                self.remove(request)
                yield request, exc
                continue
            self.remove(request)
            running += 1
            yield request, None

    def _let_go(self, request) -> None:
        if request.host is not None:
            self.held -= request.host.nbytes
            request.host = None
