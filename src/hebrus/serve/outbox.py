"""Engine events on their way from the engine thread to the event loop's request queues."""
from __future__ import annotations

import asyncio
import threading
import weakref


class Outbox:
    """Engine events on their way to the event loop's request queues. The engine thread puts
    them from its side; the first one put since the loop last drained asks the loop to drain,
    so the events of one engine turn (a token for every running request) wake the loop about
    once instead of once each. Each queue gets its events in the order they were put. Events
    for a loop that is gone (closed, or collected) are dropped: nobody is left to read them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)           # the app's table of outboxes is keyed by the loop
        self.items, self.lock = [], threading.Lock()

    def put(self, queue: asyncio.Queue, event) -> None:
        with self.lock:
            self.items.append((queue, event))
            first = len(self.items) == 1
        if not first:
            return
        loop = self.loop()
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._drain)
                return
            except RuntimeError:                # closed
                pass
        with self.lock:                         # gone: drop what waits, so later puts try again
            self.items = []

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, event in items:
            queue.put_nowait(event)
