"""Finished conversations kept for later turns, by API key (the server's `Scheduler` owns one)."""
from __future__ import annotations

import collections


class Kept:
    """Finished conversations by API key, least recently used evicted first once their rows
    and banked state pass `budget` bytes."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.entries: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()   # (key, tokens) -> (session, bytes)

    def find(self, key: str, prompt: list[int]):
        """The kept session of `key` whose tokens are the longest prefix of `prompt`, and how
        many tokens it holds; (None, 0) if none."""
        best, length = None, 0
        for (owner, tokens), (session, _) in self.entries.items():
            n = len(tokens)
            if owner == key and length < n <= len(prompt) and tuple(prompt[:n]) == tokens:
                best, length = (owner, tokens), n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best][0], length

    def put(self, key: str, tokens: list[int], session) -> None:
        size = _session_bytes(session)
        if size > self.budget:
            return
        entry = (key, tuple(tokens))
        if entry in self.entries:
            self.used -= self.entries.pop(entry)[1]
        self.entries[entry] = (session, size)
        self.used += size
        while self.used > self.budget:
            _, (_, freed) = self.entries.popitem(last=False)
            self.used -= freed


def _session_bytes(session) -> int:
    image = session.image
    banked = sum(t.numel() * t.element_size() for bank in image.banks for t in bank.values())
    return banked + sum(t.numel() * t.element_size() for t in image.public.storages)
